// enqueue, lookup and wait against a real PostgreSQL and the real daemon (harness.ts).

import assert from 'node:assert/strict';
import { after, before, test } from 'node:test';

import pg from 'pg';

import {
  InvalidMessageError,
  KeyConflictError,
  OutboxError,
  TimeoutError,
  POLL_FIRST_MS,
  POLL_MAX_MS,
  enqueue,
  lookup,
  nextPoll,
  wait,
  type MessageStatus,
  type WebhookPayload,
} from '../src/index.js';
import { holdSettleGate, startOutbox, unique, waitUntil, type Outbox } from './harness.js';

let outbox: Outbox;

before(async () => {
  outbox = await startOutbox();
});

after(async () => {
  await outbox?.stop();
});

const later = (): Date => new Date(Date.now() + 3600_000);

function webhook(path = '/ok', extra: Partial<WebhookPayload> = {}): WebhookPayload {
  return { url: outbox.receiver.url(path), body: { n: 1 }, ...extra };
}

async function count(key: string): Promise<number> {
  const r = await outbox.pool.query<{ n: number }>(
    'SELECT count(*)::int AS n FROM outbox.messages WHERE message_key = $1',
    [key],
  );
  return r.rows[0]?.n ?? -1;
}

/** Sessions holding the waiter mark (outbox.wake_waiters) in this database. */
async function waiters(): Promise<number> {
  const r = await outbox.pool.query<{ n: number }>(
    "SELECT count(*)::int AS n FROM pg_locks WHERE locktype = 'advisory' AND classid = 1869968482" +
      ' AND objid = 3 AND objsubid = 2 AND granted' +
      ' AND database = (SELECT oid FROM pg_database WHERE datname = current_database())',
  );
  return r.rows[0]?.n ?? -1;
}

test('enqueue creates, then returns the first record', async () => {
  const k = unique('dedup');
  const first = await enqueue(outbox.pool, { key: k, channel: 'webhook', payload: webhook(), runAfter: later() });
  const again = await enqueue(outbox.pool, { key: k, channel: 'webhook', payload: webhook(), runAfter: later() });
  assert.equal(first.created, true);
  assert.equal(again.created, false);
  assert.equal(again.id, first.id);
  assert.equal(await count(k), 1);
});

test('enqueue never commits: a rolled-back transaction stores nothing', async () => {
  const k = unique('rolled-back');
  const client = await outbox.pool.connect();
  try {
    await client.query('BEGIN');
    const sent = await enqueue(client, { key: k, channel: 'webhook', payload: webhook() });
    assert.equal(sent.created, true);
    await client.query('ROLLBACK');
  } finally {
    client.release();
  }
  assert.equal(await lookup(outbox.pool, k), null);
  assert.equal(await count(k), 0);
});

test('another payload under the same key is a KeyConflictError', async () => {
  const k = unique('conflict');
  await enqueue(outbox.pool, { key: k, channel: 'webhook', payload: webhook(), held: true });
  await assert.rejects(
    enqueue(outbox.pool, { key: k, channel: 'webhook', payload: webhook('/ok', { body: { n: 2 } }), held: true }),
    (err: unknown) => {
      assert.ok(err instanceof KeyConflictError && err instanceof OutboxError);
      assert.equal(err.code, 'OB409');
      assert.equal(err.key, k);
      assert.ok(err.message.includes(k));
      return true;
    },
  );
  assert.equal((await lookup(outbox.pool, k))?.state, 'held');
});

const hostile: [string, string, string, unknown, string][] = [
  ['an escape sequence in the key', 'ctl:\u001b[31mred', 'webhook', { url: 'https://example.com/h' }, 'message_key'],
  ['a newline in the key', 'line\nbreak', 'webhook', { url: 'https://example.com/h' }, 'message_key'],
  ['an over-long key', 'k'.repeat(256), 'webhook', { url: 'https://example.com/h' }, 'message_key'],
  ['an empty key', '', 'webhook', { url: 'https://example.com/h' }, 'message_key'],
  ['an array payload', 'ts-array', 'webhook', ['https://example.com/h'], 'payload'],
  ['a string payload', 'ts-string', 'webhook', 'https://example.com/h', 'payload'],
  ['a webhook without url', 'ts-no-url', 'webhook', { body: {} }, 'payload.url'],
  ['an unknown channel', 'ts-pigeon', 'pigeon', { url: 'https://example.com/h' }, 'channel'],
];

for (const [what, key, channel, payload, field] of hostile) {
  test(`bad input names the field: ${what}`, async () => {
    const message = { key, channel, payload } as unknown as Parameters<typeof enqueue>[1];
    await assert.rejects(enqueue(outbox.pool, message), (err: unknown) => {
      assert.ok(err instanceof InvalidMessageError, String(err));
      assert.equal(err.field, field, err.message);
      assert.equal(err.code, '22023');
      return true;
    });
    assert.equal(await count(key), 0);
  });
}

test('maxAttempts below one names the field', async () => {
  await assert.rejects(
    enqueue(outbox.pool, { key: unique('zero'), channel: 'webhook', payload: webhook(), maxAttempts: 0 }),
    (err: unknown) => err instanceof InvalidMessageError && err.field === 'max_attempts',
  );
});

test('lookup of an unknown key is null; of an impossible key, InvalidMessageError', async () => {
  assert.equal(await lookup(outbox.pool, unique('never')), null);
  await assert.rejects(
    lookup(outbox.pool, 'bad\u0007key'),
    (err: unknown) => err instanceof InvalidMessageError && err.field === 'message_key',
  );
});

test('lookup says when the provider\'s key window closes', async () => {
  await outbox.pool.query(
    "SELECT outbox.set_endpoint('window-ts', 'https://api.example.com', key_ttl => '24 hours')",
  );
  const k = unique('window');
  await enqueue(outbox.pool, {
    key: k,
    channel: 'http',
    payload: { endpoint: 'window-ts', path: '/v1/x' },
    held: true,
  });
  // Before a first attempt the window has not opened.
  assert.equal((await lookup(outbox.pool, k))?.keyExpiresAt, null);
  const started = new Date('2026-01-02T03:04:05Z');
  await outbox.pool.query(
    'UPDATE outbox.messages SET attempts = 1, first_attempt_at = $1 WHERE message_key = $2',
    [started, k],
  );
  const status = await lookup(outbox.pool, k);
  assert.equal(status?.keyExpiresAt?.toISOString(), '2026-01-03T03:04:05.000Z');
});

test('wait returns delivered with the stored response', async () => {
  const k = unique('delivered');
  await enqueue(outbox.pool, { key: k, channel: 'webhook', payload: webhook('/ok', { store_response: true }) });
  const status = await wait(outbox.pool, k, { timeoutMs: 30_000 });
  assert.equal(status.state, 'delivered', outbox.log());
  assert.equal(status.attempts, 1);
  const response = status.response as { status: number; body: { id: string } };
  assert.equal(response.status, 200);
  assert.match(response.body.id, /^rcpt_/);
  assert.ok(status.deliveredAt instanceof Date);
  assert.equal(outbox.receiver.seen(k), 1);
  assert.equal(await waiters(), 0, 'the wait let go of its mark');
});

test('wait is woken by the delivery', async () => {
  const k = unique('woken');
  await enqueue(outbox.pool, { key: k, channel: 'webhook', payload: webhook('/hold') });
  await waitUntil("the daemon's request", () => outbox.receiver.seen(k) === 1, 20_000);
  const waiting = wait(outbox.pool, k, { timeoutMs: 30_000 });
  await waitUntil('the waiter to hold its mark', async () => (await waiters()) === 1);
  const released = Date.now();
  outbox.receiver.release();
  const status = await waiting;
  assert.equal(status.state, 'delivered');
  assert.ok(Date.now() - released < 10_000);
});

test('wait on a held message returns at once', async () => {
  const k = unique('held');
  await enqueue(outbox.pool, { key: k, channel: 'webhook', payload: webhook(), held: true });
  const started = Date.now();
  const status = await wait(outbox.pool, k, { timeoutMs: 10_000 });
  assert.equal(status.state, 'held');
  assert.ok(Date.now() - started < 5_000);
  assert.equal(outbox.receiver.seen(k), 0);
});

test('wait returns dead for a refused delivery', async () => {
  const k = unique('dead');
  await enqueue(outbox.pool, { key: k, channel: 'webhook', payload: webhook('/reject') });
  const status = await wait(outbox.pool, k, { timeoutMs: 30_000 });
  assert.equal(status.state, 'dead');
  assert.equal(status.errorClass, 'permanent');
});

test('wait returns cancelled when an operator cancels (a change inside a SQL function)', async () => {
  const k = unique('cancelled');
  const sent = await enqueue(outbox.pool, { key: k, channel: 'webhook', payload: webhook(), runAfter: later() });
  const waiting = wait(outbox.pool, k, { timeoutMs: 30_000 });
  await waitUntil('the waiter to hold its mark', async () => (await waiters()) === 1);
  await outbox.pool.query("SELECT * FROM outbox.cancel(ARRAY[$1::bigint], 'not needed')", [sent.id]);
  assert.equal((await waiting).state, 'cancelled');
});

test('wait times out with a TimeoutError', async () => {
  const k = unique('later');
  await enqueue(outbox.pool, { key: k, channel: 'webhook', payload: webhook(), runAfter: later() });
  const started = Date.now();
  await assert.rejects(wait(outbox.pool, k, { timeoutMs: 300 }), (err: unknown) => {
    assert.ok(err instanceof TimeoutError, String(err));
    assert.match(err.message, /still pending/);
    return true;
  });
  const took = Date.now() - started;
  assert.ok(took >= 250 && took < 5_000, `${took}ms`);
  assert.equal(await waiters(), 0);
});

test('concurrent waits each see their own delivery', async () => {
  const keys = Array.from({ length: 8 }, (_, i) => unique(`many-${i}`));
  const waits: Promise<MessageStatus>[] = keys.map((k) => wait(outbox.pool, k, { timeoutMs: 30_000 }));
  const client = await outbox.pool.connect();
  try {
    await client.query('BEGIN');
    for (const k of keys) await enqueue(client, { key: k, channel: 'webhook', payload: webhook() });
    await client.query('COMMIT');
  } finally {
    client.release();
  }
  const done = await Promise.all(waits);
  assert.deepEqual(
    done.map((s) => s.state),
    keys.map(() => 'delivered'),
  );
});

/** A pool whose connections never hear a notification: as through a pooler that drops
 * LISTEN (PgBouncer in transaction mode), not even the daemon's idle claims reach a wait. */
function deafPool(): pg.Pool {
  const pool = new pg.Pool({ connectionString: outbox.url, max: 2 });
  pool.on('connect', (client) => {
    const emit = client.emit.bind(client);
    client.emit = ((event: string | symbol, ...args: unknown[]): boolean =>
      event === 'notification' ? false : emit(event, ...args)) as typeof client.emit;
  });
  return pool;
}

test('without notifications, the backing-off look ends the wait', async () => {
  const k = unique('unheard');
  const sent = await enqueue(outbox.pool, { key: k, channel: 'webhook', payload: webhook(), runAfter: later() });
  const deaf = deafPool();
  try {
    const letThrough = await holdSettleGate(outbox.pool);
    const waiting = wait(deaf, k, { timeoutMs: 8_000 });
    await letThrough();
    await outbox.pool.query("SELECT * FROM outbox.cancel(ARRAY[$1::bigint], 'unheard')", [sent.id]);
    const cancelled = Date.now();
    assert.equal((await waiting).state, 'cancelled');
    assert.ok(Date.now() - cancelled < 4_000, `${Date.now() - cancelled}ms`);
  } finally {
    await deaf.end();
  }
});

test('a key first enqueued held after the wait started is seen by the backing-off look', async () => {
  // No UPDATE announces an INSERT that is already held.
  const k = unique('held-later');
  const deaf = deafPool();
  try {
    const letThrough = await holdSettleGate(outbox.pool);
    const waiting = wait(deaf, k, { timeoutMs: 8_000 });
    await letThrough();
    await enqueue(outbox.pool, { key: k, channel: 'webhook', payload: webhook(), held: true });
    const enqueued = Date.now();
    assert.equal((await waiting).state, 'held');
    assert.ok(Date.now() - enqueued < 4_000, `${Date.now() - enqueued}ms`);
  } finally {
    await deaf.end();
  }
});

test('the pause between looks doubles from 50 ms up to 2 s', () => {
  const pauses = [POLL_FIRST_MS];
  while (pauses.length < 10) pauses.push(nextPoll(pauses[pauses.length - 1] ?? 0));
  assert.deepEqual(pauses.slice(0, 7), [50, 100, 200, 400, 800, 1600, 2000]);
  assert.equal(pauses[9], POLL_MAX_MS);
});
