// The tool wrapper: an agent's side effect, asked for once, whose answer the tool returns.
// Built only of lookup, enqueue and wait.

import type pg from 'pg';

import { enqueue, lookup, SETTLED, wait, type MessageStatus, type NewMessage } from './client.js';
import { TimeoutError } from './errors.js';

/**
 * What a tool can tell the agent:
 * - `done`: delivered; `response` is the provider's answer as stored.
 * - `failed`: it did not take effect (refused, invalid, out of attempts, or cancelled by a
 *   person); asking again under the same key returns the same.
 * - `on_its_way`: not settled within the deadline; ask again later under the same key,
 *   which never sends it twice.
 * - `needs_person`: held for a person's approval, or dead after an attempt whose effect is
 *   unknown (class `ambiguous`): a person must look before anything is sent again.
 */
export type OutcomeKind = 'done' | 'failed' | 'on_its_way' | 'needs_person';

/** What became of one call: its kind, the message's status and the provider's answer. */
export interface Outcome {
  kind: OutcomeKind;
  status: MessageStatus;
  /** The provider's last answer as stored (`status`, `body` with `store_response`), or null. */
  response: unknown;
}

const NOTES: Record<OutcomeKind, string> = {
  done: "It took effect; the provider's answer is in response.",
  failed: 'It did not take effect.',
  on_its_way: 'Not finished yet; asking again later returns the outcome, never a second send.',
  needs_person: 'A person must decide (approve it, or check whether it took effect).',
};

/** The kind of outcome a message's status tells. */
export function outcomeOf(status: MessageStatus): Outcome {
  let kind: OutcomeKind;
  if (status.state === 'delivered') kind = 'done';
  else if (status.state === 'held') kind = 'needs_person';
  else if (status.state === 'dead') kind = status.errorClass === 'ambiguous' ? 'needs_person' : 'failed';
  else if (status.state === 'cancelled') kind = 'failed';
  else kind = 'on_its_way';
  return { kind, status, response: status.response ?? null };
}

/** A JSON-able summary of an outcome to return to a model: the kind, the state, the answer
 * or the error, and a sentence saying what to do next. */
export function forAgent(outcome: Outcome): Record<string, unknown> {
  const out: Record<string, unknown> = { outcome: outcome.kind, state: outcome.status.state };
  if (outcome.response !== null) out['response'] = outcome.response;
  if (outcome.kind !== 'done' && outcome.status.lastError !== null) out['error'] = outcome.status.lastError;
  out['note'] = NOTES[outcome.kind];
  return out;
}

/** Options of `callOnce`: the message, how long to wait, and the business write. */
export type CallOnceOptions = NewMessage & {
  /** How long to wait for the outcome; past it the outcome is `on_its_way`. */
  timeoutMs: number;
  /** The business write, run in the enqueue's transaction, only by the call that created
   * the message (two racing calls write once). */
  write?: (client: pg.PoolClient) => Promise<unknown>;
};

/**
 * Asks for one side effect under `options.key` at most once, and resolves to its outcome.
 *
 * A key already known and settled resolves at once, without enqueueing or writing. Else the
 * message is enqueued on a connection of `pool`, with `write(client)`, in one transaction
 * that it commits; then it waits up to `timeoutMs` (`wait`). Rejects with what `enqueue`
 * rejects with (`KeyConflictError`, `InvalidMessageError`) and what `write` throws, after
 * rolling both back.
 */
export async function callOnce(pool: pg.Pool, options: CallOnceOptions): Promise<Outcome> {
  const { timeoutMs, write, ...message } = options;
  const known = await lookup(pool, message.key);
  if (known !== null && SETTLED.has(known.state)) return outcomeOf(known);
  const client = await pool.connect();
  try {
    await client.query('BEGIN');
    const sent = await enqueue(client, message as NewMessage);
    if (sent.created && write !== undefined) await write(client);
    await client.query('COMMIT');
  } catch (err) {
    await client.query('ROLLBACK').catch(() => undefined);
    throw err;
  } finally {
    client.release();
  }
  try {
    return outcomeOf(await wait(pool, message.key, { timeoutMs }));
  } catch (err) {
    if (!(err instanceof TimeoutError)) throw err;
    const found = await lookup(pool, message.key);
    if (found === null) throw err;
    return outcomeOf(found);
  }
}
