// callOnce (the tool wrapper) and the README's first example, which is
// examples/refund-tool.ts, against a real PostgreSQL and the real daemon.

import assert from 'node:assert/strict';
import { readFileSync } from 'node:fs';
import { dirname, resolve } from 'node:path';
import { after, before, test } from 'node:test';
import { fileURLToPath } from 'node:url';

import type pg from 'pg';

import { KeyConflictError, callOnce, forAgent, key, lookup, outcomeOf, type MessageStatus } from '../src/index.js';
import { startOutbox, unique, type Outbox } from './harness.js';

/** clients/typescript (this file runs from build/test/). */
const PACKAGE = resolve(dirname(fileURLToPath(import.meta.url)), '..', '..');

let outbox: Outbox;
let refund: (pool: pg.Pool, runId: string, step: number, orderId: number, cents: number) => Promise<Record<string, unknown>>;

before(async () => {
  outbox = await startOutbox();
  await outbox.pool.query('CREATE TABLE orders (id serial PRIMARY KEY, state text)');
  process.env['PAYMENTS_URL'] = outbox.receiver.url('');
  // Compiled beside the tests, and importing the package by its own name ('outboxd').
  ({ refund } = await import('../examples/refund-tool.js'));
});

after(async () => {
  await outbox?.stop();
});

async function order(): Promise<number> {
  const r = await outbox.pool.query<{ id: number }>("INSERT INTO orders (state) VALUES ('paid') RETURNING id");
  return r.rows[0]?.id ?? -1;
}

async function orderState(id: number): Promise<string> {
  const r = await outbox.pool.query<{ state: string }>('SELECT state FROM orders WHERE id = $1', [id]);
  return r.rows[0]?.state ?? '';
}

test("the README's and the docs' first example is examples/refund-tool.ts", () => {
  const example = readFileSync(resolve(PACKAGE, 'examples', 'refund-tool.ts'), 'utf8');
  for (const doc of [resolve(PACKAGE, 'README.md'), resolve(PACKAGE, '..', '..', 'docs', 'clients.md')]) {
    const block = /```ts\n([\s\S]*?)```/.exec(readFileSync(doc, 'utf8'))?.[1];
    assert.equal(block, example, doc);
  }
});

test('the example refunds once and returns the answer', async () => {
  const run = unique('run');
  const id = await order();
  const first = await refund(outbox.pool, run, 4, id, 2_500);
  assert.equal(first['outcome'], 'done', outbox.log());
  const response = first['response'] as { status: number; body: { id: string } };
  assert.equal(response.status, 200);
  assert.match(response.body.id, /^rcpt_/);
  assert.equal(await orderState(id), 'refunding');
  // The step runs again: nothing is sent or written again, and the answer is the same.
  await outbox.pool.query("UPDATE orders SET state = 'refunded' WHERE id = $1", [id]);
  assert.deepEqual(await refund(outbox.pool, run, 4, id, 2_500), first);
  assert.equal(outbox.receiver.seen(key(run, 4, 'refund')), 1);
  assert.equal(await orderState(id), 'refunded');
});

test('the example holds a large refund for a person', async () => {
  const run = unique('run');
  const id = await order();
  const got = await refund(outbox.pool, run, 1, id, 50_000);
  assert.equal(got['outcome'], 'needs_person');
  assert.equal(got['state'], 'held');
  assert.equal(outbox.receiver.seen(key(run, 1, 'refund')), 0);
});

test('a failed business write sends nothing', async () => {
  const k = unique('write-fails');
  await assert.rejects(
    callOnce(outbox.pool, {
      key: k,
      channel: 'webhook',
      payload: { url: outbox.receiver.url('/ok') },
      timeoutMs: 5_000,
      write: () => Promise.reject(new Error('the order is gone')),
    }),
    /the order is gone/,
  );
  assert.equal(await lookup(outbox.pool, k), null);
});

test('not settled by the deadline is on_its_way; a refusal failed; a pending key checks its payload', async () => {
  const slow = unique('slow');
  const hold = { url: outbox.receiver.url('/hold') };
  const first = await callOnce(outbox.pool, { key: slow, channel: 'webhook', payload: hold, timeoutMs: 500 });
  assert.equal(first.kind, 'on_its_way');
  await assert.rejects(
    callOnce(outbox.pool, { key: slow, channel: 'webhook', payload: { url: outbox.receiver.url('/x') }, timeoutMs: 100 }),
    (err: unknown) => err instanceof KeyConflictError,
  );
  outbox.receiver.release();
  const done = await callOnce(outbox.pool, { key: slow, channel: 'webhook', payload: hold, timeoutMs: 20_000 });
  assert.equal(done.kind, 'done');
  assert.equal(outbox.receiver.seen(slow), 1);

  const refused = unique('refused');
  const no = await callOnce(outbox.pool, {
    key: refused,
    channel: 'webhook',
    payload: { url: outbox.receiver.url('/reject') },
    timeoutMs: 20_000,
  });
  assert.equal(no.kind, 'failed');
  assert.equal(no.status.errorClass, 'permanent');
  assert.ok('error' in forAgent(no));
});

test('outcomeOf each state', () => {
  const now = new Date();
  const base: MessageStatus = {
    id: '1',
    state: 'pending',
    attempts: 0,
    maxAttempts: 3,
    errorClass: null,
    lastError: null,
    response: null,
    createdAt: now,
    updatedAt: now,
    deliveredAt: null,
    deadAt: null,
    cancelledAt: null,
    keyExpiresAt: null,
  };
  const kind = (state: MessageStatus['state'], errorClass: MessageStatus['errorClass'] = null): string =>
    outcomeOf({ ...base, state, errorClass }).kind;
  assert.equal(kind('delivered'), 'done');
  assert.equal(kind('held'), 'needs_person');
  assert.equal(kind('dead', 'ambiguous'), 'needs_person');
  assert.equal(kind('dead', 'permanent'), 'failed');
  assert.equal(kind('dead', 'exhausted'), 'failed');
  assert.equal(kind('cancelled'), 'failed');
  assert.equal(kind('pending'), 'on_its_way');
  assert.equal(kind('running'), 'on_its_way');
});
