//! The worker's connections: one pool per kind of statement, each with the session setup
//! its statements want.
//!
//! The claim and the completion run thousands of times a second under a drain, always the
//! same two prepared statements, and their pools make generic plans for them
//! ([`crate::queries::CLAIM_SETUP`]). Every commit waits for the WAL flush, completions
//! included (ARCHITECTURE.md, "Decisions worth knowing", says why). Everything else
//! (circuit breakers, releases, deferrals, the maintenance tasks) goes through the general
//! pool with the default settings: their plans follow their arguments.

use std::time::Duration;

use deadpool_postgres::Pool;

use crate::db::Database;
use crate::model::ConfigError;

/// How often the claim and completion pools throw their prepared statements away, so that
/// their generic plans are made again from the table as it is now (a plan made on an empty
/// table scans the whole table once it has grown; see [`crate::queries::CLAIM_SETUP`]).
pub const PLAN_REFRESH: Duration = Duration::from_secs(1);

/// The worker's pools.
#[derive(Clone)]
pub struct Pools {
    /// Breakers, releases, deferrals, maintenance, metrics.
    pub general: Pool,
    /// The claim loop's claims.
    pub claims: Pool,
    /// The completer's completions.
    pub completions: Pool,
}

impl Pools {
    /// The three pools on `db`; `general` connections for the general pool, two each for the
    /// others (one claim loop and one completer use them, one statement at a time; the
    /// second covers a connection being replaced).
    pub fn new(db: &Database, general: usize) -> Result<Pools, ConfigError> {
        Ok(Pools {
            general: crate::db::pool(db, general)?,
            claims: crate::db::pool_with_setup(db, 2, crate::queries::CLAIM_SETUP)?,
            completions: crate::db::pool_with_setup(db, 2, crate::queries::CLAIM_SETUP)?,
        })
    }

    /// Forgets every statement the claim and completion pools prepared; each is prepared
    /// again, and its plan made again, on its next use. Statements in use finish first
    /// (each holds its own reference).
    pub fn refresh_plans(&self) {
        self.claims.manager().statement_caches.clear();
        self.completions.manager().statement_caches.clear();
    }
}

/// One pool for everything, with its own settings (an application embedding the worker
/// with a pool it made): plans stay PostgreSQL's choice unless that pool's setup says
/// otherwise, and every commit is durable.
impl From<Pool> for Pools {
    fn from(pool: Pool) -> Pools {
        Pools {
            general: pool.clone(),
            claims: pool.clone(),
            completions: pool,
        }
    }
}
