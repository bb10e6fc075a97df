// The outbox's names for the errors its SQL functions raise.

/** An error the outbox's SQL functions raised about a message (`code` is its SQLSTATE). */
export class OutboxError extends Error {
  override name = 'OutboxError';
  constructor(
    message: string,
    readonly code: string,
    options?: { cause?: unknown },
  ) {
    super(message, options);
  }
}

/** SQLSTATE `OB409`: the key was already used with a different channel or payload. */
export class KeyConflictError extends OutboxError {
  override name = 'KeyConflictError';
  constructor(
    message: string,
    readonly key: string,
    options?: { cause?: unknown },
  ) {
    super(message, 'OB409', options);
  }
}

/** SQLSTATE `22023`: bad input; `field` names it (`message_key`, `payload`, `payload.url`, …). */
export class InvalidMessageError extends OutboxError {
  override name = 'InvalidMessageError';
  constructor(
    message: string,
    readonly field: string | null,
    options?: { cause?: unknown },
  ) {
    super(message, '22023', options);
  }
}

/** `wait` gave up: the message did not settle within `timeoutMs`. */
export class TimeoutError extends Error {
  override name = 'TimeoutError';
  constructor(
    message: string,
    readonly key: string,
    options?: { cause?: unknown },
  ) {
    super(message, options);
  }
}

/** What node-postgres gives of a server error. */
interface ServerError {
  code?: unknown;
  column?: unknown;
  message: string;
}

function isServerError(err: unknown): err is ServerError {
  return err instanceof Error && typeof (err as ServerError).code === 'string';
}

/** The outbox's name for a database error, or the error itself when it is not one of its own. */
export function translate(err: unknown, key: string): unknown {
  if (!isServerError(err)) return err;
  if (err.code === 'OB409') return new KeyConflictError(err.message, key, { cause: err });
  if (err.code === '22023') {
    const field = typeof err.column === 'string' ? err.column : null;
    return new InvalidMessageError(err.message, field, { cause: err });
  }
  return err;
}
