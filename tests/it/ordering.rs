//! Ordering keys: messages sharing an `ordering_key` are sent one at a
//! time, in id order; a retrying or dead message blocks its group; messages without a key
//! flow past. Checked at the claim (SQL), with the in-process worker, and with the real
//! binary: four processes at once, and a worker killed mid-group.

#![allow(clippy::unwrap_used)]

use crate::common;

use std::collections::{HashMap, HashSet};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use axum::body::Bytes;
use axum::http::{HeaderMap, StatusCode};
use common::binary::{outboxd, run};
use common::*;
use outboxd::claim::{self, Completion};
use outboxd::model::{Channel, ErrorClass};
use outboxd::state::Transition;
use outboxd::{EnqueueError, NewMessage};

const WEBHOOK: &[Channel] = &[Channel::Webhook];

/// A webhook in group `g` (or none) with its place `seq` in the body.
fn msg(key: &str, url: &str, g: Option<&str>, seq: usize) -> NewMessage {
    let m = NewMessage::webhook(
        key,
        serde_json::json!({"url": url, "body": {"g": g, "seq": seq}}),
    );
    match g {
        Some(g) => m.ordering_key(g),
        None => m,
    }
}

/// `groups` groups of `per` messages each (`g{i}:{seq}`, group `g{i}`), enqueued
/// interleaved (g0:0, g1:0, …, g0:1, …) in one call, plus `keyless` messages without a key.
async fn enqueue_groups(db: &TestDb, url: &str, groups: usize, per: usize, keyless: usize) {
    let c = db.client().await;
    let mut msgs = Vec::new();
    for seq in 0..per {
        for g in 0..groups {
            let group = format!("g{g}");
            msgs.push(msg(&format!("{group}:{seq}"), url, Some(&group), seq));
        }
    }
    for i in 0..keyless {
        msgs.push(msg(&format!("free:{i}"), url, None, i));
    }
    outboxd::enqueue_many(&c, &msgs).await.unwrap();
}

async fn claim_n(c: &tokio_postgres::Client, n: usize, worker: &str) -> Vec<claim::Claimed> {
    let mut got = claim::claim(c, WEBHOOK, n, worker, Duration::from_secs(60))
        .await
        .unwrap();
    got.sort_by_key(|m| m.id);
    got
}

fn completion(m: &claim::Claimed, transition: Transition) -> Completion {
    Completion {
        id: m.id,
        lease_token: m.lease_token,
        attempt: m.attempt,
        transition,
        error: transition.error_class().map(|_| "test failure".to_owned()),
        status: Some(500),
        deduplicated: false,
        response: None,
        started_at: SystemTime::now(),
    }
}

fn keys(ms: &[claim::Claimed]) -> Vec<String> {
    ms.iter().map(|m| m.key.clone()).collect()
}

async fn blocked_groups(db: &TestDb) -> i64 {
    let c = db.client().await;
    outboxd::status::status(&c).await.unwrap().blocked_groups
}

// ---------------------------------------------------------------------------------------
// A receiver that knows about groups
// ---------------------------------------------------------------------------------------

/// What the group receiver saw of one request, in the order requests ended.
#[derive(Debug, Clone)]
struct Seen {
    key: String,
    group: Option<String>,
    seq: usize,
    status: u16,
}

#[derive(Default)]
struct GroupState {
    /// Requests in flight per group right now.
    in_flight: HashMap<String, usize>,
    /// Times a request arrived while another of its group was in flight.
    overlaps: Vec<String>,
    /// Every request that was answered.
    seen: Vec<Seen>,
    /// Keys that get 500 this many more times.
    fail: HashMap<String, usize>,
    /// Keys that get 410 (dead at once) while listed.
    gone: HashSet<String>,
    /// Keys whose first request stalls (for a kill mid-request).
    stall_once: HashSet<String>,
    /// Keys that arrived, answered or not.
    arrived: Vec<String>,
}

/// An HTTP receiver on loopback that tracks requests in flight per group (the body's `g`),
/// holds each request `hold` so that overlaps would be seen, and answers per key.
#[derive(Clone)]
struct GroupReceiver {
    url: String,
    state: Arc<Mutex<GroupState>>,
}

/// Decrements the group's in-flight count however the handler ends (also when the worker
/// that sent the request is killed and the connection drops).
struct InFlight(Arc<Mutex<GroupState>>, Option<String>);

impl Drop for InFlight {
    fn drop(&mut self) {
        if let Some(g) = &self.1 {
            if let Some(n) = self.0.lock().unwrap().in_flight.get_mut(g) {
                *n = n.saturating_sub(1);
            }
        }
    }
}

impl GroupReceiver {
    async fn start(hold: Duration) -> GroupReceiver {
        let state = Arc::new(Mutex::new(GroupState::default()));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}/hook", listener.local_addr().unwrap());
        let st = state.clone();
        let app = axum::Router::new().fallback(move |headers: HeaderMap, body: Bytes| {
            let st = st.clone();
            async move {
                let key = headers
                    .get("idempotency-key")
                    .and_then(|v| v.to_str().ok())
                    .unwrap_or("")
                    .to_owned();
                let v: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
                let group = v["g"].as_str().map(str::to_owned);
                let seq = v["seq"].as_u64().unwrap_or(0) as usize;
                let stall = {
                    let mut s = st.lock().unwrap();
                    s.arrived.push(key.clone());
                    if let Some(g) = &group {
                        let n = s.in_flight.entry(g.clone()).or_default();
                        *n += 1;
                        if *n > 1 {
                            s.overlaps.push(key.clone());
                        }
                    }
                    s.stall_once.remove(&key)
                };
                let _guard = InFlight(st.clone(), group.clone());
                if stall {
                    tokio::time::sleep(Duration::from_secs(30)).await;
                }
                tokio::time::sleep(hold).await;
                let mut s = st.lock().unwrap();
                let status = if s.gone.contains(&key) {
                    410
                } else if let Some(n) = s.fail.get_mut(&key).filter(|n| **n > 0) {
                    *n -= 1;
                    500
                } else {
                    204
                };
                s.seen.push(Seen {
                    key,
                    group,
                    seq,
                    status,
                });
                StatusCode::from_u16(status).unwrap()
            }
        });
        tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        GroupReceiver { url, state }
    }

    fn seen(&self) -> Vec<Seen> {
        self.state.lock().unwrap().seen.clone()
    }

    fn overlaps(&self) -> Vec<String> {
        self.state.lock().unwrap().overlaps.clone()
    }

    fn arrived(&self) -> Vec<String> {
        self.state.lock().unwrap().arrived.clone()
    }

    fn delivered(&self) -> usize {
        self.seen().iter().filter(|s| s.status == 204).count()
    }
}

/// Checks every group's requests against the rule: a request for member `seq` arrives only
/// once every earlier member was delivered (a repeat of an already delivered one, after a
/// lease expired, is allowed when `repeats_ok`). Returns the number of groups checked.
fn assert_in_group_order(seen: &[Seen], repeats_ok: bool) -> usize {
    let mut next: HashMap<&str, usize> = HashMap::new();
    for s in seen {
        let Some(g) = s.group.as_deref() else {
            continue;
        };
        let n = next.entry(g).or_default();
        assert!(
            s.seq <= *n,
            "{} (seq {}) was sent before {g}:{} was delivered",
            s.key,
            s.seq,
            *n
        );
        assert!(
            repeats_ok || s.seq == *n,
            "{} was sent again after it was delivered",
            s.key
        );
        if s.seq == *n && s.status == 204 {
            *n += 1;
        }
    }
    next.len()
}

fn spawn_worker(db: &TestDb, id: &str, lease: &str) -> Child {
    Command::new(env!("CARGO_BIN_EXE_outboxd"))
        .args(["run", "--worker-id", id, "--concurrency", "16"])
        .args([
            "--batch-size",
            "20",
            "--lease",
            lease,
            "--webhook-timeout",
            "1s",
        ])
        .args([
            "--poll-interval",
            "100ms",
            "--retry-base",
            "100ms",
            "--retry-max",
            "1s",
        ])
        .env_clear()
        .env("PATH", std::env::var("PATH").unwrap_or_default())
        .env("DATABASE_URL", db.url())
        .env("OUTBOXD_ALLOW_PRIVATE_NETWORKS", "true")
        .env("RUST_LOG", "error")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap()
}

// ---------------------------------------------------------------------------------------
// Enqueue
// ---------------------------------------------------------------------------------------

/// Every enqueue path sets the column; every call that worked before 0012 still does.
#[tokio::test]
async fn every_enqueue_path_sets_the_ordering_key_and_old_calls_still_work() {
    let db = TestDb::new().await;
    let c = db.client().await;
    let p = r#"{"url": "https://example.com/h"}"#;
    for sql in [
        "SELECT outbox.enqueue('six', 'webhook', $1::text::jsonb, now(), 3, true)",
        "SELECT outbox.enqueue('seven', 'webhook', $1::text::jsonb, now(), 3, true, false)",
        "SELECT outbox.enqueue('named', 'webhook', $1::text::jsonb, ordering_key => 'order-1')",
        "SELECT outbox.enqueue('eight', 'webhook', $1::text::jsonb, now(), 3, true, false, 'order-2')",
        "SELECT id FROM outbox.enqueue_row('row', 'webhook', $1::text::jsonb, ordering_key => 'order-3')",
        "SELECT id FROM outbox.enqueue_many(ARRAY['m1', 'm2'], ARRAY['webhook', 'webhook'], \
         ARRAY[$1::text::jsonb, $1::text::jsonb])",
        "SELECT id FROM outbox.enqueue_many(ARRAY['m3', 'm4'], ARRAY['webhook', 'webhook'], \
         ARRAY[$1::text::jsonb, $1::text::jsonb], ordering_key => ARRAY['order-4', NULL])",
    ] {
        c.query(sql, &[&p])
            .await
            .unwrap_or_else(|e| panic!("{sql}: {e}"));
    }
    c.execute(
        "INSERT INTO outbox.messages (message_key, channel, payload, ordering_key) \
         VALUES ('insert', 'webhook', $1::text::jsonb, 'order-5')",
        &[&p],
    )
    .await
    .unwrap();
    outboxd::enqueue(
        &c,
        &msg("rust", "https://example.com/h", Some("order-6"), 0),
    )
    .await
    .unwrap();
    outboxd::enqueue_many(
        &c,
        &[
            msg("rust-many-1", "https://example.com/h", Some("order-7"), 0),
            msg("rust-many-2", "https://example.com/h", None, 0),
        ],
    )
    .await
    .unwrap();
    let out = run(outboxd(Some(&db.url())).args([
        "enqueue",
        "--key",
        "cli",
        "--channel",
        "webhook",
        "--payload",
        p,
        "--ordering-key",
        "order-8",
    ]));
    assert_eq!(out.code, Some(0), "{}", out.stderr);
    // `show` names the group (text and JSON).
    let shown = run(outboxd(Some(&db.url())).args(["show", "cli"]));
    assert!(
        shown.stdout.contains("  ordering_key order-8\n"),
        "{}",
        shown.stdout
    );
    let shown = run(outboxd(Some(&db.url())).args(["show", "cli", "--json"]));
    let v: serde_json::Value = serde_json::from_str(&shown.stdout).unwrap();
    assert_eq!(v["ordering_key"], "order-8");
    let got: HashMap<String, Option<String>> = c
        .query("SELECT message_key, ordering_key FROM outbox.messages", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    let want: HashMap<String, Option<String>> = [
        ("six", None),
        ("seven", None),
        ("named", Some("order-1")),
        ("eight", Some("order-2")),
        ("row", Some("order-3")),
        ("m1", None),
        ("m2", None),
        ("m3", Some("order-4")),
        ("m4", None),
        ("insert", Some("order-5")),
        ("rust", Some("order-6")),
        ("rust-many-1", Some("order-7")),
        ("rust-many-2", None),
        ("cli", Some("order-8")),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v.map(str::to_owned)))
    .collect();
    assert_eq!(got, want);
    // The ordering key is not part of the fingerprint: the same key and payload with another
    // ordering key is the same side effect, and returns the stored row unchanged.
    let same_payload =
        serde_json::json!({"url": "https://example.com/h", "body": {"g": "order-6", "seq": 0}});
    let again = outboxd::enqueue(
        &c,
        &NewMessage::webhook("rust", same_payload).ordering_key("other"),
    )
    .await
    .unwrap();
    assert!(!again.created);
    let stored: Option<String> = c
        .query_one(
            "SELECT ordering_key FROM outbox.messages WHERE message_key = 'rust'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(stored.as_deref(), Some("order-6"));
}

/// Control characters, over-long and empty keys, whitespace at the edges and NUL are
/// refused on every path with 22023 naming `ordering_key` (the message key's rules); SQL
/// quotes are stored as they are and name one group like any other text.
#[tokio::test]
async fn hostile_ordering_keys_are_refused_or_stored_verbatim() {
    let db = TestDb::new().await;
    let c = db.client().await;
    let url = "https://example.com/h";
    let long = "k".repeat(10_000);
    for bad in [
        "",
        " lead",
        "trail\t",
        "a\nb",
        "esc\u{1b}[31m",
        "bidi\u{202e}x",
        "c1\u{85}",
        &long,
    ] {
        for (i, m) in [
            plain("bad", bad),
            NewMessage::email(
                "bad",
                serde_json::json!({"to": ["a@example.com"], "text": "x"}),
            )
            .ordering_key(bad),
        ]
        .iter()
        .enumerate()
        {
            let err = outboxd::enqueue(&c, m).await.unwrap_err();
            let EnqueueError::Invalid { field, message } = &err else {
                panic!("{bad:?} ({i}): {err:?}");
            };
            assert_eq!(field, "ordering_key", "{bad:?}: {message}");
            assert!(message.starts_with("ordering_key must"), "{message}");
            assert!(
                message.len() < 200,
                "the error does not quote the key back: {message}"
            );
        }
        let err = outboxd::enqueue_many(&c, &[msg("ok", url, None, 0), plain("bad", bad)])
            .await
            .unwrap_err();
        assert!(
            matches!(&err, EnqueueError::Invalid { field, .. } if field == "ordering_key"),
            "{bad:?}: {err:?}"
        );
        let err = c
            .execute(
                "INSERT INTO outbox.messages (message_key, channel, payload, ordering_key) \
                 VALUES ('bad', 'webhook', '{\"url\": \"https://example.com/\"}', $1)",
                &[&bad],
            )
            .await
            .unwrap_err();
        let db_err = err.as_db_error().unwrap();
        assert_eq!(db_err.code().code(), "22023", "{bad:?}");
        assert_eq!(db_err.column(), Some("ordering_key"));
    }
    // NUL cannot reach the database as text at all; the error names the right field.
    let err = outboxd::enqueue(&c, &plain("nul", "a\0b"))
        .await
        .unwrap_err();
    assert!(
        matches!(&err, EnqueueError::Invalid { field, .. } if field == "ordering_key"),
        "{err:?}"
    );
    // The CLI: exit 2, one line naming the field.
    let out = run(outboxd(Some(&db.url())).args([
        "enqueue",
        "--key",
        "cli-bad",
        "--channel",
        "webhook",
        "--payload",
        r#"{"url": "https://example.com/"}"#,
        "--ordering-key",
        "a\u{7}b",
    ]));
    assert_eq!(out.code, Some(2), "{}", out.stderr);
    assert_eq!(out.stderr_lines().len(), 1, "{}", out.stderr);
    assert!(
        out.stderr
            .contains("ordering_key must not contain control characters"),
        "{}",
        out.stderr
    );
    // Nothing was stored by any of the refusals.
    let n: i64 = db.scalar("SELECT count(*) FROM outbox.messages").await;
    assert_eq!(n, 0);
    // An update cannot store an over-long key either (the CHECK constraint).
    outboxd::enqueue(&c, &msg("upd", url, Some("x"), 0))
        .await
        .unwrap();
    let err = c
        .execute(
            "UPDATE outbox.messages SET ordering_key = repeat('x', 256) WHERE message_key = 'upd'",
            &[],
        )
        .await
        .unwrap_err();
    assert_eq!(err.as_db_error().unwrap().code().code(), "23514");
    // Quotes and SQL are text: stored verbatim, one group.
    let sqlish = "o'; DROP TABLE outbox.messages; --";
    for (i, k) in ["q0", "q1"].iter().enumerate() {
        outboxd::enqueue(&c, &msg(k, url, Some(sqlish), i))
            .await
            .unwrap();
    }
    let stored: Vec<Option<String>> = first_column(
        &c,
        "SELECT ordering_key FROM outbox.messages WHERE message_key IN ('q0', 'q1')",
    )
    .await;
    assert_eq!(stored, [Some(sqlish.to_owned()), Some(sqlish.to_owned())]);
    let got = claim_n(&c, 10, "w").await;
    assert_eq!(
        keys(&got),
        ["upd", "q0"],
        "q1 waits behind q0 in the quoted group"
    );
}

/// A webhook whose payload does not name its group (so a hostile ordering key is tested
/// alone, not as part of the payload).
fn plain(key: &str, ordering_key: &str) -> NewMessage {
    NewMessage::webhook(key, serde_json::json!({"url": "https://example.com/h"}))
        .ordering_key(ordering_key)
}

/// Ids within a group follow commit order: a second transaction enqueueing into a group
/// waits while the first is open, and its message gets the later id; another group does
/// not wait.
#[tokio::test]
async fn ids_within_a_group_follow_commit_order() {
    let db = TestDb::new().await;
    let mut first = db.client().await;
    let url = "https://example.com/h";
    let tx = first.transaction().await.unwrap();
    let a = outboxd::enqueue(&tx, &msg("a", url, Some("g"), 0))
        .await
        .unwrap()
        .id;
    // Another group is not held up by the open transaction.
    let other = db.client().await;
    outboxd::enqueue(&other, &msg("other", url, Some("h"), 0))
        .await
        .unwrap();
    let second = db.client().await;
    let pid = backend_pid(&second).await;
    let waiter = tokio::spawn(async move {
        outboxd::enqueue(&second, &msg("b", url, Some("g"), 1))
            .await
            .unwrap()
            .id
    });
    let watch = db.client().await;
    wait_for_backend_wait(
        &watch,
        pid,
        "advisory",
        "the second enqueue to wait for the group",
    )
    .await;
    assert!(!waiter.is_finished());
    tx.commit().await.unwrap();
    let b = tokio::time::timeout(Duration::from_secs(10), waiter)
        .await
        .unwrap()
        .unwrap();
    assert!(b > a, "the later commit has the later id ({b} > {a})");
}

// ---------------------------------------------------------------------------------------
// The claim
// ---------------------------------------------------------------------------------------

/// One claim takes the head of each group and every keyless message, whatever the batch
/// size; the next member becomes claimable only once the head is delivered.
#[tokio::test]
async fn the_claim_takes_one_per_group_in_id_order() {
    let db = TestDb::new().await;
    enqueue_groups(&db, "https://example.com/h", 3, 3, 2).await;
    let c = db.client().await;
    let first = claim_n(&c, 100, "w").await;
    assert_eq!(keys(&first), ["g0:0", "g1:0", "g2:0", "free:0", "free:1"]);
    assert!(
        claim_n(&c, 100, "w").await.is_empty(),
        "every group has one in flight"
    );
    assert_eq!(blocked_groups(&db).await, 3);
    // g0's head delivered, g1's retried (not due for 30 s), g2's dead.
    let done = [
        completion(&first[0], Transition::Delivered),
        completion(
            &first[1],
            Transition::Retry {
                class: ErrorClass::Transient,
                delay: Duration::from_secs(30),
            },
        ),
        completion(
            &first[2],
            Transition::Dead {
                class: ErrorClass::Permanent,
            },
        ),
    ];
    claim::complete(&c, "w", &done).await.unwrap();
    assert_eq!(
        keys(&claim_n(&c, 100, "w").await),
        ["g0:1"],
        "a retry and a dead head block their groups"
    );
    assert_eq!(blocked_groups(&db).await, 3);
}

/// For keyed messages the completion SQL still writes exactly what `decide` says, and the
/// state it writes decides whether the group moves on: only a delivered head lets the next
/// member be claimed; a retry (pending, not due) and a dead head block it.
#[tokio::test]
async fn the_state_machine_still_holds_for_keyed_messages() {
    let db = TestDb::new().await;
    let transitions = [
        Transition::Delivered,
        Transition::Retry {
            class: ErrorClass::Transient,
            delay: Duration::from_secs(30),
        },
        Transition::Retry {
            class: ErrorClass::Ambiguous,
            delay: Duration::from_secs(30),
        },
        Transition::Dead {
            class: ErrorClass::Permanent,
        },
        Transition::Dead {
            class: ErrorClass::Invalid,
        },
        Transition::Dead {
            class: ErrorClass::Exhausted,
        },
        Transition::Dead {
            class: ErrorClass::Ambiguous,
        },
    ];
    enqueue_groups(&db, "https://example.com/h", transitions.len(), 2, 0).await;
    let c = db.client().await;
    let heads = claim_n(&c, 100, "w").await;
    assert_eq!(heads.len(), transitions.len());
    let batch: Vec<Completion> = heads
        .iter()
        .zip(transitions)
        .map(|(m, t)| completion(m, t))
        .collect();
    claim::complete(&c, "w", &batch).await.unwrap();
    let next: HashSet<String> = keys(&claim_n(&c, 100, "w").await).into_iter().collect();
    for (m, t) in heads.iter().zip(transitions) {
        let r = c
            .query_one(
                "SELECT state, error_class, run_after > now() + interval '20 seconds', \
                 delivered_at IS NOT NULL, dead_at IS NOT NULL, lease_token IS NULL, ordering_key \
                 FROM outbox.messages WHERE id = $1",
                &[&m.id],
            )
            .await
            .unwrap();
        assert_eq!(r.get::<_, String>(0), t.next_state().as_str(), "{t:?}");
        assert_eq!(
            r.get::<_, Option<String>>(1).as_deref(),
            t.error_class().map(|c| c.as_str()),
            "{t:?}"
        );
        assert_eq!(
            r.get::<_, bool>(2),
            matches!(t, Transition::Retry { .. }),
            "{t:?}"
        );
        assert_eq!(r.get::<_, bool>(3), t == Transition::Delivered, "{t:?}");
        assert_eq!(
            r.get::<_, bool>(4),
            matches!(t, Transition::Dead { .. }),
            "{t:?}"
        );
        assert!(r.get::<_, bool>(5), "lease cleared for {t:?}");
        let group: String = r.get(6);
        let member = format!("{group}:1");
        assert_eq!(
            next.contains(&member),
            t == Transition::Delivered,
            "{member} claimable after its head's {t:?}"
        );
    }
}

/// A dead head blocks its group until it is replayed (then it goes first) or cancelled
/// (then the next member goes); a held head blocks until approved. Keyless messages and
/// other groups are claimed meanwhile.
#[tokio::test]
async fn dead_and_held_heads_block_until_an_operator_acts() {
    let db = TestDb::new().await;
    let c = db.client().await;
    let url = "https://example.com/h";
    for (k, g, seq) in [
        ("a:0", "a", 0),
        ("a:1", "a", 1),
        ("b:0", "b", 0),
        ("b:1", "b", 1),
    ] {
        outboxd::enqueue(&c, &msg(k, url, Some(g), seq))
            .await
            .unwrap();
    }
    outboxd::enqueue(&c, &msg("h:0", url, Some("h"), 0).held(true))
        .await
        .unwrap();
    outboxd::enqueue(&c, &msg("h:1", url, Some("h"), 1))
        .await
        .unwrap();
    let heads = claim_n(&c, 100, "w").await;
    assert_eq!(keys(&heads), ["a:0", "b:0"], "the held head blocks h:1");
    let dead: Vec<_> = heads
        .iter()
        .map(|m| {
            completion(
                m,
                Transition::Dead {
                    class: ErrorClass::Permanent,
                },
            )
        })
        .collect();
    claim::complete(&c, "w", &dead).await.unwrap();
    outboxd::enqueue(&c, &msg("free", url, None, 0))
        .await
        .unwrap();
    assert_eq!(
        keys(&claim_n(&c, 100, "w").await),
        ["free"],
        "dead heads block; keyless flows"
    );
    assert_eq!(blocked_groups(&db).await, 3);
    let (a0, b0) = (heads[0].id, heads[1].id);
    c.query(outboxd::queries::REPLAY, &[&vec![a0], &"t"])
        .await
        .unwrap();
    c.query(
        outboxd::queries::CANCEL,
        &[&vec![b0], &None::<String>, &"t"],
    )
    .await
    .unwrap();
    let h0: i64 = db
        .scalar("SELECT id FROM outbox.messages WHERE message_key = 'h:0'")
        .await;
    c.query(outboxd::queries::APPROVE, &[&vec![h0], &"t"])
        .await
        .unwrap();
    assert_eq!(
        keys(&claim_n(&c, 100, "w").await),
        ["a:0", "b:1", "h:0"],
        "the replayed head goes first; a cancelled head lets the next go; an approved head goes"
    );
    assert_eq!(
        blocked_groups(&db).await,
        2,
        "a and h still have a member waiting"
    );
}

/// Eight connections claim and complete concurrently, in small batches: no group ever has
/// two messages running at once (checked by a watcher), and each group's messages are
/// claimed in id order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_claims_keep_one_per_group() {
    const GROUPS: usize = 10;
    const PER: usize = 20;
    let db = TestDb::new().await;
    enqueue_groups(&db, "https://example.com/h", GROUPS, PER, 50).await;
    let order: Arc<Mutex<Vec<(String, i64)>>> = Arc::default();
    let mut tasks = Vec::new();
    for w in 0..8 {
        let c = db.client().await;
        let order = order.clone();
        tasks.push(tokio::spawn(async move {
            let worker = format!("w{w}");
            let mut idle = 0;
            while idle < 20 {
                let got = claim_n(&c, 3, &worker).await;
                if got.is_empty() {
                    idle += 1;
                    tokio::time::sleep(Duration::from_millis(5)).await;
                    continue;
                }
                idle = 0;
                {
                    let mut o = order.lock().unwrap();
                    for m in &got {
                        o.push((m.key.clone(), m.id));
                    }
                }
                tokio::time::sleep(Duration::from_millis(2)).await;
                let done: Vec<_> = got
                    .iter()
                    .map(|m| completion(m, Transition::Delivered))
                    .collect();
                claim::complete(&c, &worker, &done).await.unwrap();
            }
        }));
    }
    let watcher = db.client().await;
    let mut doubles = Vec::new();
    loop {
        let rows = watcher
            .query(
                "SELECT ordering_key FROM outbox.messages WHERE state = 'running' \
                 AND ordering_key IS NOT NULL GROUP BY ordering_key HAVING count(*) > 1",
                &[],
            )
            .await
            .unwrap();
        doubles.extend(rows.iter().map(|r| r.get::<_, String>(0)));
        if tasks.iter().all(|t| t.is_finished()) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    for t in tasks {
        t.await.unwrap();
    }
    assert!(
        doubles.is_empty(),
        "groups with two running at once: {doubles:?}"
    );
    let delivered: i64 = db
        .scalar("SELECT count(*) FROM outbox.messages WHERE state = 'delivered'")
        .await;
    assert_eq!(delivered, (GROUPS * PER + 50) as i64);
    let mut last: HashMap<String, i64> = HashMap::new();
    for (key, id) in order.lock().unwrap().iter() {
        let Some((g, _)) = key.split_once(':').filter(|(g, _)| *g != "free") else {
            continue;
        };
        let prev = last.insert(g.to_owned(), *id);
        assert!(
            prev.is_none_or(|p| p < *id),
            "{key} claimed out of id order"
        );
    }
}

// ---------------------------------------------------------------------------------------
// With a worker
// ---------------------------------------------------------------------------------------

/// The first message of each group fails with 500 twice: the group's second message never
/// arrives before the first's success, and keyless messages flow meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn order_is_kept_across_retries() {
    let db = TestDb::new().await;
    let rx = GroupReceiver::start(Duration::ZERO).await;
    {
        let mut s = rx.state.lock().unwrap();
        for g in 0..3 {
            s.fail.insert(format!("g{g}:0"), 2);
        }
    }
    enqueue_groups(&db, &rx.url, 3, 4, 5).await;
    let worker = RunningWorker::start(&db, test_worker_config("w"), test_webhook_config());
    let c = db.client().await;
    wait_for_count(&c, "delivered", 17, Duration::from_secs(30)).await;
    worker.stop().await;
    let seen = rx.seen();
    assert_eq!(assert_in_group_order(&seen, false), 3);
    assert_eq!(seen.iter().filter(|s| s.status == 500).count(), 6);
    for g in 0..3 {
        let head = attempts(&db, &format!("g{g}:0")).await;
        let outcomes: Vec<&str> = head.iter().map(|a| a.1.as_str()).collect();
        assert_eq!(outcomes, ["retry", "retry", "delivered"]);
    }
    // Keyless messages did not wait for the retries: all of them were answered before the
    // last head's success.
    let last_head = seen
        .iter()
        .rposition(|s| s.seq == 0 && s.group.is_some() && s.status == 204)
        .unwrap();
    let free_done = seen.iter().rposition(|s| s.group.is_none()).unwrap();
    assert!(
        free_done < last_head,
        "keyless messages flowed past the retrying groups"
    );
}

/// A dead head blocks its group (with the daemon running) and shows in `status`; after a
/// replay the group drains in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_head_blocks_its_group_until_replayed() {
    let db = TestDb::new().await;
    let rx = GroupReceiver::start(Duration::ZERO).await;
    rx.state.lock().unwrap().gone.insert("g0:0".into());
    enqueue_groups(&db, &rx.url, 2, 3, 3).await;
    let worker = RunningWorker::start(&db, test_worker_config("w"), test_webhook_config());
    let c = db.client().await;
    wait_for_count(&c, "delivered", 6, Duration::from_secs(30)).await;
    wait_for_state(&db, "g0:0", "dead", Duration::from_secs(10)).await;
    let out = run(outboxd(Some(&db.url())).args(["status", "--json"]));
    assert_eq!(out.code, Some(0), "{}", out.stderr);
    let st: serde_json::Value = serde_json::from_str(&out.stdout).unwrap();
    assert_eq!(st["blocked_groups"], 1, "{}", out.stdout);
    let text = run(outboxd(Some(&db.url())).args(["status"]));
    assert!(
        text.stdout.contains("blocked ordering groups: 1"),
        "{}",
        text.stdout
    );
    // Nothing of g0 after its head was sent, while g1 and the keyless ones were.
    let arrived = rx.arrived();
    assert!(
        !arrived.iter().any(|k| k == "g0:1" || k == "g0:2"),
        "{arrived:?}"
    );
    rx.state.lock().unwrap().gone.clear();
    let out = run(outboxd(Some(&db.url())).args(["replay", "g0:0"]));
    assert_eq!(out.code, Some(0), "{}", out.stderr);
    wait_for_count(&c, "delivered", 9, Duration::from_secs(30)).await;
    worker.stop().await;
    assert_eq!(assert_in_group_order(&rx.seen(), false), 2);
    assert_eq!(blocked_groups(&db).await, 0);
}

/// Four `outboxd run` processes, 20 groups of 20 messages and 100 keyless ones: every group
/// arrives in id order, and the receiver never sees two of a group in flight at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_worker_processes_keep_every_group_in_order() {
    let db = TestDb::new().await;
    let rx = GroupReceiver::start(Duration::from_millis(5)).await;
    enqueue_groups(&db, &rx.url, 20, 20, 100).await;
    let mut workers: Vec<Child> = (0..4)
        .map(|i| spawn_worker(&db, &format!("w{i}"), "5s"))
        .collect();
    let c = db.client().await;
    wait_for_count(&c, "delivered", 500, Duration::from_secs(90)).await;
    for w in &mut workers {
        let _ = w.kill();
        let _ = w.wait();
    }
    let seen = rx.seen();
    assert_eq!(
        rx.overlaps(),
        Vec::<String>::new(),
        "two of a group in flight at once"
    );
    assert_eq!(assert_in_group_order(&seen, false), 20);
    assert_eq!(rx.delivered(), 500);
    // All four took part (the groups were not serialised onto one worker).
    let workers_used: i64 = db
        .scalar("SELECT count(DISTINCT worker) FROM outbox.attempts WHERE outcome = 'delivered'")
        .await;
    assert!(workers_used >= 2, "{workers_used} workers delivered");
}

/// A worker is SIGKILLed while a group's second message is in flight: the next member is not
/// sent until that message's lease expired and it was sent again and delivered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn order_survives_a_worker_killed_mid_group() {
    let db = TestDb::new().await;
    let rx = GroupReceiver::start(Duration::ZERO).await;
    rx.state.lock().unwrap().stall_once.insert("g0:1".into());
    enqueue_groups(&db, &rx.url, 1, 5, 0).await;
    let mut first = spawn_worker(&db, "doomed", "5s");
    wait_until(
        Duration::from_secs(20),
        "g0:1 to reach the receiver",
        || async { rx.arrived().iter().any(|k| k == "g0:1") },
    )
    .await;
    first.kill().unwrap();
    let _ = first.wait();
    let r = row(&db, "g0:1").await;
    assert_eq!(r.state, "running", "killed while in flight");
    let mut second = spawn_worker(&db, "heir", "5s");
    let c = db.client().await;
    wait_for_count(&c, "delivered", 5, Duration::from_secs(30)).await;
    let _ = second.kill();
    let _ = second.wait();
    let seen = rx.seen();
    assert_eq!(assert_in_group_order(&seen, true), 1);
    let arrived = rx.arrived();
    let pos = |k: &str| arrived.iter().position(|a| a == k).unwrap();
    let resent = arrived.iter().rposition(|a| a == "g0:1").unwrap();
    assert!(
        resent > pos("g0:1"),
        "g0:1 was sent again after the kill: {arrived:?}"
    );
    assert!(
        pos("g0:2") > resent,
        "g0:2 waited for g0:1's second attempt: {arrived:?}"
    );
    let outcomes: Vec<String> = attempts(&db, "g0:1")
        .await
        .into_iter()
        .map(|a| a.1)
        .collect();
    assert_eq!(outcomes, ["lease_lost", "delivered"]);
}

/// A message waiting behind its group's dead head is never claimed, so it has no attempt
/// to log; the worker's ordering watch logs the held-up group instead (`deferred=ordering`,
/// the group, how many wait, the head and its state), without the URL.
#[tokio::test]
async fn a_group_held_up_by_its_dead_head_is_logged_as_deferred_ordering() {
    let (logs, _guard) = LogCapture::install();
    let db = TestDb::new().await;
    let rx = common::receiver::Receiver::start().await;
    rx.script([common::receiver::Reply::Status(400)]);
    let url = rx.url("/hook?token=s3cret");
    let c = db.client().await;
    let msgs: Vec<NewMessage> = (0..3)
        .map(|i| msg(&format!("order-9:{i}"), &url, Some("order-9"), i).max_attempts(1))
        .collect();
    outboxd::enqueue_many(&c, &msgs).await.unwrap();
    let worker = RunningWorker::start(&db, test_worker_config("w"), test_webhook_config());
    wait_for_state(&db, "order-9:0", "dead", Duration::from_secs(10)).await;
    wait_until(Duration::from_secs(10), "the ordering watch's line", || {
        let logs = logs.clone();
        async move { logs.text().contains("ordering group waits for its head") }
    })
    .await;
    worker.stop().await;
    let text = logs.text();
    let line = text
        .lines()
        .find(|l| l.contains("ordering group waits for its head"))
        .unwrap();
    for part in [
        "deferred=\"ordering\"",
        "ordering_key=order-9",
        "waiting=2",
        "head=order-9:0",
        "head_state=dead",
    ] {
        assert!(line.contains(part), "{part} in {line}");
    }
    assert!(
        !text.contains("s3cret") && !text.contains("/hook"),
        "{text}"
    );
    assert_eq!(
        rx.requests().len(),
        1,
        "nothing after the dead head was sent"
    );
}

/// A purge of old dead letters keeps every dead message of an ordering group: the contract
/// has it block its group until it is replayed or cancelled. Deleting a dead head sent the
/// next message of its group as if the head had been dealt with; and one with nothing
/// behind it (a replay once let that one go) left its group open to a message enqueued later.
/// A dead message without an ordering key goes, as any other old dead letter.
#[tokio::test]
async fn a_purge_keeps_the_dead_of_an_ordering_group() {
    let db = TestDb::new().await;
    let c = db.client().await;
    let url = "https://example.com/h";
    for m in [
        msg("plain:dead", url, None, 0),
        msg("held-up:head", url, Some("g"), 0),
        msg("held-up:next", url, Some("g"), 1),
        msg("alone:dead", url, Some("solo"), 0),
    ] {
        outboxd::enqueue(&c, &m).await.unwrap();
    }
    c.batch_execute(
        "UPDATE outbox.messages SET state = 'dead', attempts = 3, error_class = 'permanent', \
         last_error = 'HTTP 410', dead_at = now() - interval '3 days' \
         WHERE message_key IN ('held-up:head', 'alone:dead', 'plain:dead')",
    )
    .await
    .unwrap();
    let purged: i64 = db
        .scalar("SELECT outbox.purge(interval '2 days', true)")
        .await;
    assert_eq!(purged, 1, "only the dead message without an ordering key");
    assert_eq!(row(&db, "held-up:head").await.state, "dead");
    assert_eq!(row(&db, "alone:dead").await.state, "dead");
    // A message of the lone dead one's group, enqueued after the purge, waits for it too.
    outboxd::enqueue(&c, &msg("alone:later", url, Some("solo"), 0))
        .await
        .unwrap();
    assert!(
        claim_n(&c, 10, "w").await.is_empty(),
        "both groups stay held up"
    );
}
