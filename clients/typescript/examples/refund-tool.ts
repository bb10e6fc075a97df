import type pg from 'pg';
import { callOnce, forAgent, key } from 'outboxd';

const PAYMENTS = process.env['PAYMENTS_URL'] ?? 'https://pay.example.com';

/** An agent's tool: refunds an order at most once per step of a run, however often the
 * step runs again, and returns what the payment provider answered. */
export async function refund(
  pool: pg.Pool,
  runId: string,
  step: number,
  orderId: number,
  cents: number,
): Promise<Record<string, unknown>> {
  const outcome = await callOnce(pool, {
    key: key(runId, step, 'refund'), // from durable ids: the same on every retry
    channel: 'webhook',
    payload: { url: `${PAYMENTS}/refunds`, body: { order: orderId, cents }, store_response: true },
    held: cents > 10_000, // a large refund waits for a person's approval
    // The business write, in the same transaction as the enqueue.
    write: (client) => client.query("UPDATE orders SET state = 'refunding' WHERE id = $1", [orderId]),
    timeoutMs: 20_000,
  });
  // outcome.kind: 'done' (outcome.response is the provider's answer), 'on_its_way',
  // 'needs_person' (held, or an attempt whose effect is unknown) or 'failed'.
  return forAgent(outcome);
}
