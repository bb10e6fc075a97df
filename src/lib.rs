//! outboxd: a transactional outbox for webhooks, provider API calls and e-mails on PostgreSQL.
//!
//! Applications write *intent rows* into `outbox.messages` in the same transaction as their
//! business state ([`enqueue()`], or `outbox.enqueue(...)` from SQL). A worker ([`worker`])
//! claims due rows under a lease, sends each with its stable key so providers can
//! deduplicate, and records the result: delivered, retried later, or dead-lettered.
//! Delivery is at least once; the key makes "more than once" harmless to a receiver that
//! honours it.
//!
//! # Public API
//!
//! Applications use the crate root: [`enqueue()`], [`enqueue_many`], [`NewMessage`],
//! [`lookup()`] (what became of a key, before acting again) and the vocabulary in [`model`];
//! with `default-features = false` the package builds only those. [`migrate`], [`worker`],
//! [`config`] and [`deliver`] serve a service that runs the worker in-process. The modules hidden from these docs are public
//! only for the integration tests and carry no compatibility promise.
//!
//! # Layout
//!
//! * [`model`]: the shared vocabulary: channels, states, outcomes, error classes.
//! * [`migrate`]: the SQL files in `sql/`, embedded, applied in order under an advisory lock.
//! * [`mod@enqueue`]: the library face applications call inside their own transaction.
//! * [`mod@lookup`]: what became of a key (`outbox.lookup`), for the application role.
//! * [`queries`]: every runtime SQL statement, each with its contract, one room per user
//!   (connection, lease, enqueue, migrate, status, ops, breakers).
//! * [`claim`]: the lease: claiming due rows, completing attempts fenced by the lease token,
//!   releasing unstarted rows. A claimed row carries the destination the insert trigger
//!   named; the worker only checks it ([`deliver::webhook::destination`]).
//! * [`state`]: the state machine: states, outcomes and the one function ([`state::decide`])
//!   that maps an attempt's result to the next state.
//! * [`retry`]: error classes and the retry schedule.
//! * [`deliver`]: the channels, each owning its settings; [`deliver::webhook`] sends HTTP
//!   requests (payload, signing, error classification), [`deliver::http`] calls providers'
//!   APIs through named endpoints with the credentials the worker holds, [`deliver::guard`]
//!   keeps both off
//!   private networks, [`deliver::email`] sends e-mails through an SMTP relay (payload,
//!   MIME, the SMTP session by phase, reply classification, the connection pool).
//! * [`worker`]: the loop: claim, deliver with bounded concurrency, complete in batches.
//! * [`status`]: counts for operators.
//! * [`ops`]: operator actions, a room each: dead letters, held messages, show, replay, the
//!   checkpoints (approve, cancel, confirm) and the seen-state check, purge, destinations.
//! * [`cli`]: the command line, one room per command (`args`, `run`, `enqueue`, `ops`); the
//!   binary is a thin `main` around [`cli::dispatch`].
//! * [`console`]: `outboxd console`, the operator console in the browser (server-rendered
//!   HTML; sign-in, sessions and CSRF in `console::auth`).
//! * [`metrics`]: Prometheus metrics and the health endpoint.
//! * [`config`]: the worker's settings, parsed and validated once at start-up;
//!   [`config::assemble`] turns raw flag and environment values into them, cross-field rules
//!   included.
//! * [`support`]: one copy of each small shared helper (mutex lock, host name, error causes).
//! * [`db`]: connections and the pool.
//! * [`logging`]: the log subscriber the binary sets up, the text format (fields escaped,
//!   timestamps cached per second) and where lines go ([`logging::sink`]: stderr through a
//!   bounded queue, so a broken or full stderr drops (and counts) lines instead of panicking
//!   or blocking the worker).
//! * [`telemetry`]: traces, a span per attempt over OTLP/HTTP, off unless an endpoint is set.
//! * [`text`]: stored text made safe to print (control characters as visible escapes).

#[cfg(feature = "daemon")]
#[doc(hidden)]
pub mod claim;
#[cfg(feature = "daemon")]
#[doc(hidden)]
pub mod cli;
#[cfg(feature = "daemon")]
pub mod config;
#[cfg(feature = "daemon")]
#[doc(hidden)]
pub mod console;
#[cfg(feature = "daemon")]
#[doc(hidden)]
pub mod db;
#[cfg(feature = "daemon")]
pub mod deliver;
pub mod enqueue;
#[cfg(feature = "daemon")]
#[doc(hidden)]
pub mod logging;
pub mod lookup;
#[cfg(feature = "daemon")]
#[doc(hidden)]
pub mod metrics;
#[cfg(feature = "daemon")]
pub mod migrate;
pub mod model;
#[cfg(feature = "daemon")]
#[doc(hidden)]
pub mod ops;
#[doc(hidden)]
pub mod queries;
#[cfg(feature = "daemon")]
#[doc(hidden)]
pub mod retry;
#[cfg(feature = "daemon")]
#[doc(hidden)]
pub mod state;
#[cfg(feature = "daemon")]
#[doc(hidden)]
pub mod status;
#[doc(hidden)]
pub mod support;
#[cfg(feature = "daemon")]
pub mod telemetry;
#[doc(hidden)]
pub mod text;
#[cfg(feature = "daemon")]
pub mod worker;

pub use enqueue::{EnqueueError, Enqueued, NewMessage, enqueue, enqueue_many};
pub use lookup::{LookupError, MessageStatus, lookup};
pub use model::{Channel, ErrorClass, State};

/// The Rust snippets of README.md and `docs/`, compiled by `cargo test --doc`, so that what a
/// newcomer copies builds (`tests/it/docs.rs` checks that every page with one is here).
#[cfg(all(doctest, feature = "daemon"))]
pub mod doc_snippets {
    #[doc = include_str!("../README.md")]
    pub struct Readme;
    #[doc = include_str!("../docs/enqueue.md")]
    pub struct Enqueue;
    #[doc = include_str!("../docs/checkpoints-and-reconciliation.md")]
    pub struct CheckpointsAndReconciliation;
    #[doc = include_str!("../docs/agents.md")]
    pub struct Agents;
}
