//! The worker's connections: one pool for the claims and completions, one for the rest,
//! each with the session setup its statements want.
//!
//! The claim and the completion run thousands of times a second under a drain, always the
//! same two prepared statements, and their pool makes generic plans for them
//! ([`crate::queries::CLAIM_SETUP`]). Every commit waits for the WAL flush, completions
//! included (ARCHITECTURE.md, "Decisions worth knowing", says why). Everything else
//! (circuit breakers, releases, deferrals, the maintenance tasks) goes through the general
//! pool with the default settings: their plans follow their arguments.

use std::time::Duration;

use deadpool_postgres::Pool;

use crate::db::Database;
use crate::model::ConfigError;

/// How often the claim and completion pool throws its prepared statements away, so that
/// their generic plans are made again from the table as it is now (a plan made on an empty
/// table scans the whole table once it has grown; see [`crate::queries::CLAIM_SETUP`]).
pub const PLAN_REFRESH: Duration = Duration::from_secs(1);

/// The worker's pools.
#[derive(Clone)]
pub struct Pools {
    /// Breakers, releases, deferrals, maintenance, metrics.
    pub general: Pool,
    /// The claim loop's claims and the completer's completions, on generic plans.
    pub hot: Pool,
    /// Whether `hot` is the worker's own pool, whose prepared statements
    /// [`Pools::refresh_plans`] may throw away. An application's pool (`From<Pool>`) is not:
    /// its statement cache holds the application's statements too, and emptying it every
    /// second would make the application prepare them again and again.
    remake_plans: bool,
}

impl Pools {
    /// The two pools on `db`: `general` connections for the general pool, and for the hot
    /// one a connection per claim that may be in flight
    /// ([`MAX_CLAIMS`](super::MAX_CLAIMS)) and one for the completer, which
    /// runs one statement at a time.
    pub fn new(db: &Database, general: usize) -> Result<Pools, ConfigError> {
        let hot = super::MAX_CLAIMS + 1;
        Ok(Pools {
            general: crate::db::pool(db, general)?,
            hot: crate::db::pool_with_setup(db, hot, crate::queries::CLAIM_SETUP)?,
            remake_plans: true,
        })
    }

    /// Forgets every statement the hot pool prepared; each is prepared again, and its plan
    /// made again, on its next use. Statements in use finish first (each holds its own
    /// reference). Does nothing to an application's pool (`From<Pool>`): its plans are
    /// PostgreSQL's choice, remade when autovacuum's ANALYZE changes the table's statistics,
    /// and its cache is the application's.
    pub fn refresh_plans(&self) {
        if self.remake_plans {
            self.hot.manager().statement_caches.clear();
        }
    }
}

/// One pool for everything, with its own settings (an application embedding the worker
/// with a pool it made): plans stay PostgreSQL's choice unless that pool's setup says
/// otherwise, commits are as durable as that pool's `synchronous_commit` makes them (the
/// worker's own pools raise `off` and `local` for claims; this one is the application's),
/// and the worker leaves the pool's statement cache alone.
impl From<Pool> for Pools {
    fn from(pool: Pool) -> Pools {
        Pools {
            general: pool.clone(),
            hot: pool,
            remake_plans: false,
        }
    }
}
