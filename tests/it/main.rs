//! The integration tests, as one binary: one link instead of one per file (on two cores
//! the links cost more than many of the tests), and one process in which the migrated
//! template database (`common::template`) is made once. Each module is the room of one
//! concern; `common` is the harness (a database per test, receivers, the real binary).

#![allow(clippy::unwrap_used)]

mod common;

mod bad_input;
mod breakers;
mod channel_pauses;
mod checkpoints;
mod cli;
mod cli_bad_args;
mod client_build;
mod console;
mod console_charts;
mod console_destinations;
mod console_messages;
mod daemon;
mod demo;
mod destinations;
mod docs;
mod email;
mod endpoints;
mod enqueue;
mod failover;
mod hostile_sql;
mod http_channel;
mod leases;
mod migrations;
mod ops;
mod ordering;
mod pauses;
mod pg_tls;
mod pools;
mod privileges;
mod properties;
mod providers;
mod reconcile;
mod reliability;
mod results;

mod secrets;
mod signing_keys;
mod smoke;
mod ssrf;
mod tidy;
mod traces;
mod waiting;
mod wakeups;
mod webhook;
mod webhook_tls;
