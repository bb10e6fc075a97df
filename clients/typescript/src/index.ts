// outboxd's client for Node: enqueue side effects in your own transaction, look their keys
// up, and wait for their outcome. Thin over the SQL functions of the `outbox` schema.

export { enqueue, lookup, nextPoll, wait, POLL_FIRST_MS, POLL_MAX_MS, SETTLED } from './client.js';
export type { Enqueued, ErrorClass, MessageStatus, NewMessage, Queryable, State, WaitOptions } from './client.js';
export { InvalidMessageError, KeyConflictError, OutboxError, TimeoutError } from './errors.js';
export { key } from './key.js';
export { callOnce, forAgent, outcomeOf } from './tool.js';
export type { CallOnceOptions, Outcome, OutcomeKind } from './tool.js';
export type {
  Channel,
  EmailPayload,
  Headers,
  HttpPayload,
  HttpReconcile,
  JsonValue,
  Payloads,
  WebhookPayload,
} from './payloads.js';
