// The harness: a database of its own on DATABASE_URL's server, migrated by the real
// `outboxd migrate`; a local HTTP receiver; the real `outboxd run` delivering to it.
// OUTBOXD_BIN names the binary (default: the repository's target/debug/outboxd).

import { execFile, spawn, type ChildProcess } from 'node:child_process';
import { randomBytes } from 'node:crypto';
import { existsSync } from 'node:fs';
import http from 'node:http';
import type { AddressInfo } from 'node:net';
import { dirname, resolve } from 'node:path';
import { fileURLToPath } from 'node:url';
import { promisify } from 'node:util';

import pg from 'pg';

const here = dirname(fileURLToPath(import.meta.url));
/** The repository's root (this file runs from clients/typescript/build/test/). */
export const ROOT = resolve(here, '..', '..', '..', '..');
export const VECTORS = resolve(ROOT, 'clients', 'key-vectors.json');

/** Records each request's path and Idempotency-Key. `/ok` answers 200 with a JSON body,
 * `/reject` 400, and `/hold` waits until `release()` before answering 200. */
export class Receiver {
  readonly requests: { path: string; key: string }[] = [];
  private held: (() => void)[] = [];
  private released = false;
  private constructor(private readonly server: http.Server) {}

  static async start(): Promise<Receiver> {
    const server = http.createServer();
    const receiver = new Receiver(server);
    server.on('request', (req, res) => receiver.handle(req, res));
    await new Promise<void>((ok) => server.listen(0, '127.0.0.1', ok));
    return receiver;
  }

  private handle(req: http.IncomingMessage, res: http.ServerResponse): void {
    req.resume();
    req.on('end', () => {
      const path = req.url ?? '/';
      const key = req.headers['idempotency-key'];
      this.requests.push({ path, key: typeof key === 'string' ? key : '' });
      const answer = (): void => {
        const body = JSON.stringify({ id: `rcpt_${this.requests.length}` });
        res.writeHead(path === '/reject' ? 400 : 200, { 'Content-Type': 'application/json' });
        res.end(body);
      };
      if (path === '/hold' && !this.released) this.held.push(answer);
      else answer();
    });
  }

  url(path: string): string {
    const { port } = this.server.address() as AddressInfo;
    return `http://127.0.0.1:${port}${path}`;
  }

  seen(key: string): number {
    return this.requests.filter((r) => r.key === key).length;
  }

  release(): void {
    this.released = true;
    for (const answer of this.held.splice(0)) answer();
  }

  async close(): Promise<void> {
    this.release();
    this.server.closeAllConnections();
    await new Promise<void>((ok) => this.server.close(() => ok()));
  }
}

/** The suite's database (`url`, `pool`), receiver and daemon. */
export interface Outbox {
  url: string;
  pool: pg.Pool;
  receiver: Receiver;
  /** The daemon's last output, for a failing assertion's message. */
  log(): string;
  stop(): Promise<void>;
}

function withDatabase(url: string, name: string): string {
  const u = new URL(url);
  u.pathname = `/${name}`;
  return u.toString();
}

export async function startOutbox(): Promise<Outbox> {
  const admin = process.env['DATABASE_URL'];
  if (!admin) throw new Error('DATABASE_URL is not set: run the tests with scripts/test');
  const binary = process.env['OUTBOXD_BIN'] ?? resolve(ROOT, 'target', 'debug', 'outboxd');
  if (!existsSync(binary)) throw new Error(`${binary} does not exist: run \`cargo build\` first`);
  const name = `outboxd_ts_${process.pid}_${randomBytes(4).toString('hex')}`;
  await adminQuery(admin, `CREATE DATABASE "${name}"`);
  const url = withDatabase(admin, name);
  const env = { ...process.env, DATABASE_URL: url, OUTBOXD_ALLOW_PRIVATE_NETWORKS: 'true' };
  let receiver: Receiver | undefined;
  let daemon: ChildProcess | undefined;
  let pool: pg.Pool | undefined;
  let output = '';
  const stop = async (): Promise<void> => {
    await pool?.end();
    if (daemon !== undefined && daemon.exitCode === null && daemon.signalCode === null) {
      const exited = new Promise((ok) => daemon?.once('exit', ok));
      daemon.kill('SIGTERM');
      const timer = setTimeout(() => daemon?.kill('SIGKILL'), 20_000);
      await exited;
      clearTimeout(timer);
    }
    await receiver?.close();
    await adminQuery(admin, `DROP DATABASE IF EXISTS "${name}" WITH (FORCE)`);
  };
  try {
    await promisify(execFile)(binary, ['migrate'], { env, timeout: 60_000 });
    receiver = await Receiver.start();
    daemon = spawn(binary, ['run', '--worker-id', 'ts-tests', '--retry-base', '1s'], {
      env,
      stdio: ['ignore', 'pipe', 'pipe'],
    });
    const keep = (chunk: Buffer): void => {
      output = (output + chunk.toString()).slice(-4000);
    };
    daemon.stdout?.on('data', keep);
    daemon.stderr?.on('data', keep);
    pool = new pg.Pool({ connectionString: url, max: 20 });
    return { url, pool, receiver, log: () => output, stop };
  } catch (err) {
    await stop();
    throw err;
  }
}

async function adminQuery(url: string, sql: string): Promise<void> {
  const c = new pg.Client({ connectionString: url });
  await c.connect();
  try {
    await c.query(sql);
  } finally {
    await c.end();
  }
}

/** Waits for a condition, checked every few milliseconds, up to a deadline. */
export async function waitUntil(what: string, cond: () => Promise<boolean> | boolean, timeoutMs = 10_000): Promise<void> {
  const deadline = Date.now() + timeoutMs;
  while (!(await cond())) {
    if (Date.now() > deadline) throw new Error(`timed out after ${timeoutMs}ms waiting for ${what}`);
    await new Promise((ok) => setTimeout(ok, 20));
  }
}

/** A key of this test's own (the tests of a file share its database). */
export function unique(name: string): string {
  return `ts-${randomBytes(4).toString('hex')}:${name}`;
}

/**
 * Holds the settle gate in share mode (as a change that decided not to notify would) and
 * resolves to a function that resolves once the one wait started meanwhile has queued
 * behind it, passed it and made its look after it: what happens next is seen only by a
 * later look.
 */
export async function holdSettleGate(pool: pg.Pool): Promise<() => Promise<void>> {
  const thisDb = 'l.database = (SELECT oid FROM pg_database WHERE datname = current_database())';
  const count = async (sql: string): Promise<number> =>
    (await pool.query<{ n: number }>(sql)).rows[0]?.n ?? -1;
  const gate = await pool.connect();
  try {
    await gate.query('BEGIN');
    await gate.query('SELECT pg_advisory_xact_lock_shared(1869968482, 4)');
  } catch (err) {
    gate.release(true);
    throw err;
  }
  return async () => {
    try {
      await waitUntil(
        'the wait to queue at the settle gate',
        async () =>
          (await count(
            "SELECT count(*)::int AS n FROM pg_locks l WHERE l.locktype = 'advisory'" +
              ` AND l.classid = 1869968482 AND l.objid = 4 AND NOT l.granted AND ${thisDb}`,
          )) === 1,
      );
      await gate.query('COMMIT');
    } finally {
      gate.release(true);
    }
    await waitUntil(
      "the wait's look after the gate",
      async () =>
        (await count(
          'SELECT count(*)::int AS n FROM pg_locks l JOIN pg_stat_activity a USING (pid)' +
            " WHERE l.locktype = 'advisory' AND l.classid = 1869968482 AND l.objid = 3" +
            ` AND l.objsubid = 2 AND l.granted AND ${thisDb}` +
            " AND a.state = 'idle' AND a.query LIKE '%outbox.lookup%'",
        )) === 1,
    );
  };
}
