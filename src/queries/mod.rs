//! Every statement the runtime sends, in one place, each with its contract.
//!
//! Migrations live in `sql/`; these are the queries of the running system. Nothing else in
//! the crate writes SQL text (the enqueue functions, the migration runner and the worker all
//! take their statements from here), and each one is exercised against a real database by
//! the integration tests.
//!
//! One room per user of the statements: `connection` (set-up, checks, wake-ups), `lease`,
//! `enqueue` (the application's), `migrate`, `status`, `ops` (operators and the console),
//! `endpoints` (the operators' endpoint commands and the worker's reading of the table),
//! `breakers`, `destinations` (pauses, and the console's destination pages) and `console`
//! (the console's listing of every message); `channels` (channels a person paused). Each
//! re-exported here, so a statement is `queries::NAME` wherever it lives.

mod breakers;
mod channels;
mod connection;
mod console;
mod destinations;
mod endpoints;
mod enqueue;
mod lease;
mod migrate;
mod ops;
mod status;

pub use breakers::*;
pub use channels::*;
pub use connection::*;
pub use console::*;
pub use destinations::*;
pub use endpoints::*;
pub use enqueue::*;
pub use lease::*;
pub use migrate::*;
pub use ops::*;
pub use status::*;
