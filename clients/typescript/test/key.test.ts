// key(): the shared vectors (clients/key-vectors.json), which the Python tests read too.

import assert from 'node:assert/strict';
import { readFileSync } from 'node:fs';
import { test } from 'node:test';

import { key } from '../src/index.js';
import { VECTORS } from './harness.js';

interface Vector {
  parts: (string | number)[];
  key?: string;
  error?: string;
}

const vectors = (JSON.parse(readFileSync(VECTORS, 'utf8')) as { vectors: Vector[] }).vectors;

for (const v of vectors) {
  test(`key(${JSON.stringify(v.parts)})`, () => {
    if (v.error !== undefined) assert.throws(() => key(...v.parts), RangeError);
    else assert.equal(key(...v.parts), v.key);
  });
}

test('parts never collide', () => {
  assert.notEqual(key('a:b', 'c'), key('a', 'b:c'));
  assert.notEqual(key('a%3Ab'), key('a:b'));
});

test('a part is a string or an integer', () => {
  assert.equal(key('order', 42n), 'order:42');
  assert.throws(() => key('a', 1.5), TypeError);
  assert.throws(() => key('a', true as unknown as string), TypeError);
});
