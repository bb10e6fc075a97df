// enqueue, lookup and wait: thin over outbox.enqueue_row and outbox.lookup. The rules (what
// a valid message is, what a conflict is) live in PostgreSQL; here they only get names.

import type pg from 'pg';

import { TimeoutError, translate } from './errors.js';
import type { Channel, Payloads } from './payloads.js';

/** A message's state, as `outbox.messages.state` holds it. */
export type State = 'pending' | 'running' | 'delivered' | 'dead' | 'held' | 'cancelled';

/** The class of a message's last failure. */
export type ErrorClass = 'transient' | 'ambiguous' | 'permanent' | 'invalid' | 'exhausted';

/** Anything node-postgres can run a query on: a `Client`, a `PoolClient` or a `Pool`. */
export type Queryable = pg.ClientBase | pg.Pool;

/** One message to enqueue; `payload`'s type follows `channel`. */
export type NewMessage = {
  [C in Channel]: {
    /** The operation key, from durable ids (see `key()`): 1 to 255 characters. */
    key: string;
    channel: C;
    payload: Payloads[C];
    /** Not sent before this time (default: now). */
    runAfter?: Date | null;
    /** The whole budget of attempts, the first included (default 3). */
    maxAttempts?: number;
    /** May an attempt whose outcome is unknown be retried (default true). */
    retryAmbiguous?: boolean;
    /** Wait for a person's approval before sending (default false). */
    held?: boolean;
    /** Messages sharing an ordering key are sent one at a time, in id order. */
    orderingKey?: string | null;
  };
}[Channel];

/** What `enqueue` did. */
export interface Enqueued {
  /** The message's id (a `bigint` column: a decimal string, as node-postgres gives it). */
  id: string;
  /** False when the key already existed with the same channel and payload. */
  created: boolean;
}

/** What is known of one message: the columns of `outbox.lookup` (no payload). */
export interface MessageStatus {
  id: string;
  state: State;
  attempts: number;
  maxAttempts: number;
  errorClass: ErrorClass | null;
  lastError: string | null;
  /** The provider's last answer: status, message id, replayed flag, and `body` with `store_response`. */
  response: unknown;
  createdAt: Date;
  updatedAt: Date;
  deliveredAt: Date | null;
  deadAt: Date | null;
  cancelledAt: Date | null;
  /** When the provider's memory of the key ends (endpoints with a `key_ttl`); else null. */
  keyExpiresAt: Date | null;
}

/** The states `wait` returns on: the daemon has nothing more to do (held waits for a person). */
export const SETTLED: ReadonlySet<State> = new Set<State>(['delivered', 'dead', 'cancelled', 'held']);

const ENQUEUE =
  'SELECT id, created FROM outbox.enqueue_row($1::text, $2::text, $3::jsonb, $4::timestamptz,' +
  ' $5::int, $6::boolean, $7::boolean, $8::text)';
const LOOKUP = 'SELECT * FROM outbox.lookup($1::text)';

/**
 * Enqueues one message on `client`, in its current transaction if it has one (the rules of
 * `outbox.enqueue`). It never commits: nothing is sent unless the caller's transaction does.
 *
 * The same key with the same channel and payload resolves to the existing message with
 * `created: false`, whatever its state. Rejects with `KeyConflictError` for the same key with
 * another channel or payload, `InvalidMessageError` (naming the field) for bad input.
 */
export async function enqueue(client: Queryable, message: NewMessage): Promise<Enqueued> {
  const params = [
    message.key,
    message.channel,
    // Always as JSON text: node-postgres would write a JS array as a PostgreSQL array.
    JSON.stringify(message.payload),
    message.runAfter ?? null,
    message.maxAttempts ?? 3,
    message.retryAmbiguous ?? true,
    message.held ?? false,
    message.orderingKey ?? null,
  ];
  let result: pg.QueryResult<{ id: string; created: boolean }>;
  try {
    result = await client.query(ENQUEUE, params);
  } catch (err) {
    throw translate(err, message.key);
  }
  const row = result.rows[0];
  if (row === undefined) throw new Error('outbox.enqueue_row returned no row');
  return { id: row.id, created: row.created };
}

interface LookupRow {
  id: string;
  state: State;
  attempts: number;
  max_attempts: number;
  error_class: ErrorClass | null;
  last_error: string | null;
  response: unknown;
  created_at: Date;
  updated_at: Date;
  delivered_at: Date | null;
  dead_at: Date | null;
  cancelled_at: Date | null;
  key_expires_at: Date | null;
}

/**
 * What is known of the message with this key (`outbox.lookup`), or `null` for a key never
 * enqueued. Rejects with `InvalidMessageError` for a key no enqueue could have stored.
 */
export async function lookup(client: Queryable, key: string): Promise<MessageStatus | null> {
  let result: pg.QueryResult<LookupRow>;
  try {
    result = await client.query(LOOKUP, [key]);
  } catch (err) {
    throw translate(err, key);
  }
  const r = result.rows[0];
  if (r === undefined) return null;
  return {
    id: r.id,
    state: r.state,
    attempts: r.attempts,
    maxAttempts: r.max_attempts,
    errorClass: r.error_class,
    lastError: r.last_error,
    response: r.response,
    createdAt: r.created_at,
    updatedAt: r.updated_at,
    deliveredAt: r.delivered_at,
    deadAt: r.dead_at,
    cancelledAt: r.cancelled_at,
    keyExpiresAt: r.key_expires_at,
  };
}

/** Options of `wait`. */
export interface WaitOptions {
  /** How long to wait before rejecting with `TimeoutError`. */
  timeoutMs: number;
}

// As sql/0001_baseline.sql describes at outbox.wake_waiters: listen, take the waiter mark,
// pass the settle gate once, then look the key up on each notification.
const LISTEN = 'LISTEN outbox_settled';
const UNLISTEN = 'UNLISTEN outbox_settled';
const TAKE_MARK = 'SELECT pg_advisory_lock_shared(1869968482, 3)';
const DROP_MARK = 'SELECT pg_advisory_unlock_shared(1869968482, 3)';
const GATE_TIMEOUT = "SELECT set_config('lock_timeout', $1, true)";
const PASS_GATE = 'SELECT pg_advisory_xact_lock(1869968482, 4)';
const LOCK_NOT_AVAILABLE = '55P03';

/** The first pause between two looks of `wait` when no notification comes, in ms. */
export const POLL_FIRST_MS = 50;
/** The longest pause between two looks of `wait`, in ms. */
export const POLL_MAX_MS = 2_000;

/**
 * The pause after `pauseMs`: twice as long, at most `POLL_MAX_MS`. The notification is the
 * quick path; the look at the pause's end is the fallback for one that never comes (a
 * pooler that drops LISTEN, as PgBouncer's transaction mode does; a key first enqueued
 * already held, which no UPDATE announces).
 */
export function nextPoll(pauseMs: number): number {
  return Math.min(pauseMs * 2, POLL_MAX_MS);
}

/**
 * Waits until the message with this key is delivered, dead, cancelled or held, and resolves
 * to its status; rejects with `TimeoutError` if it is not within `timeoutMs`.
 *
 * A connection taken from `pool` for the wait LISTENs on `outbox_settled` and looks the key
 * up again on each notification; between notifications it also looks again after a pause
 * that starts at 50 ms and doubles up to 2 s, so that a lost notification (a pooler that
 * drops LISTEN) or a key first enqueued already held still ends the wait. The connection
 * goes back to the pool afterwards. A key not yet enqueued (or not yet committed) is waited
 * for like a pending one.
 */
export async function wait(pool: pg.Pool, key: string, options: WaitOptions): Promise<MessageStatus> {
  const deadline = Date.now() + options.timeoutMs;
  const client = await pool.connect();
  // Set by a notification (or a lost connection) that arrives at any time, a lookup
  // included, so that none is missed between a lookup and the wait that follows it.
  let woken = false;
  let failure: unknown = null;
  let wake: (() => void) | null = null;
  const onNotification = (msg: pg.Notification): void => {
    if (msg.channel !== 'outbox_settled') return;
    woken = true;
    wake?.();
  };
  const onError = (err: unknown): void => {
    failure = err;
    wake?.();
  };
  client.on('notification', onNotification);
  client.on('error', onError);
  let broken = false;
  try {
    await client.query(LISTEN);
    await client.query(TAKE_MARK);
    let found = await lookup(client, key);
    if (found !== null && SETTLED.has(found.state)) return found;
    // Every transaction that changed a state without notifying (it saw no waiter) has
    // ended once the gate is ours: what it did is visible to the lookups from here on.
    await passGate(client, key, deadline, found, options.timeoutMs);
    let pause = POLL_FIRST_MS;
    for (;;) {
      woken = false;
      found = await lookup(client, key);
      if (found !== null && SETTLED.has(found.state)) return found;
      const remaining = deadline - Date.now();
      if (remaining <= 0) throw timedOut(key, options.timeoutMs, found);
      if (!woken) {
        let timer: NodeJS.Timeout | undefined;
        await new Promise<void>((resolve) => {
          wake = resolve;
          timer = setTimeout(resolve, Math.min(pause, remaining));
        });
        clearTimeout(timer);
        wake = null;
      }
      pause = nextPoll(pause);
      if (failure !== null) throw failure;
    }
  } catch (err) {
    broken = failure !== null;
    throw err;
  } finally {
    client.off('notification', onNotification);
    client.off('error', onError);
    await release(client, broken);
  }
}

async function passGate(
  client: pg.PoolClient,
  key: string,
  deadline: number,
  found: MessageStatus | null,
  timeoutMs: number,
): Promise<void> {
  await client.query('BEGIN');
  try {
    await client.query(GATE_TIMEOUT, [`${Math.max(1, deadline - Date.now())}ms`]);
    await client.query(PASS_GATE);
    await client.query('COMMIT');
  } catch (err) {
    await client.query('ROLLBACK').catch(() => undefined);
    if ((err as { code?: unknown }).code === LOCK_NOT_AVAILABLE) {
      throw timedOut(key, timeoutMs, found, err);
    }
    throw err;
  }
}

/** Drops the mark and stops listening, then gives the connection back; a connection that
 * failed, or cannot be cleaned, is destroyed instead. */
async function release(client: pg.PoolClient, broken: boolean): Promise<void> {
  if (broken) {
    client.release(true);
    return;
  }
  try {
    await client.query(DROP_MARK);
    await client.query(UNLISTEN);
    client.release();
  } catch (err) {
    client.release(err instanceof Error ? err : true);
  }
}

function timedOut(key: string, timeoutMs: number, found: MessageStatus | null, cause?: unknown): TimeoutError {
  const where = found === null ? 'not found' : `still ${found.state}`;
  return new TimeoutError(
    `message ${JSON.stringify(key)} is ${where} after ${timeoutMs}ms`,
    key,
    cause === undefined ? undefined : { cause },
  );
}
