//! The console's listing of every message (`GET /messages`) and the database's clock, which
//! its relative times are computed from.

/// The filters of the message listing, shared by its statements (one text, so the page
/// and its count cannot disagree on what matches). Every parameter is NULL for "any":
/// `$1` state, `$2` channel, `$3` and `$4` a key range (`$3 <= message_key < $4`: the keys
/// that start with a prefix, computed by the caller; `$4` NULL for no upper bound), `$5`
/// "enqueued within the last N seconds", `$6` destination (a host as the column stores
/// it), `$7` an http message's endpoint name.
///
/// The statements are sent unnamed, so PostgreSQL plans each with its values and drops
/// the filters that are NULL: a key range reads the unique index on `message_key` (whose
/// collation is `C`, so a range of bytes is a range of the index), a state with its own
/// partial index (`dead`, `held`, …) reads that index, and with no filter the primary key
/// is read backwards. A key range is a plain comparison, so `%` and `_` in a prefix are
/// themselves, with nothing to escape.
macro_rules! messages_where {
    () => {
        r#"
WHERE ($1::text IS NULL OR state = $1::text)
  AND ($2::text IS NULL OR channel = $2::text)
  AND ($3::text IS NULL OR message_key >= $3::text)
  AND ($4::text IS NULL OR message_key < $4::text)
  AND ($5::float8 IS NULL OR created_at >= now() - make_interval(secs => $5::float8))
  AND ($6::text IS NULL OR destination = $6::text)
  AND ($7::text IS NULL OR (channel = 'http' AND payload ->> 'endpoint' = $7::text))
"#
    };
}

/// The columns of a listed message, in the order `ops::messages` reads them.
macro_rules! messages_columns {
    () => {
        r#"
SELECT id, message_key, channel, state, attempts, max_attempts, error_class, last_error,
       destination, created_at, updated_at
FROM outbox.messages
"#
    };
}

/// Console: messages matching the filters of `messages_where!` (`$1`..`$7`), newest (by
/// id) first, with an id below `$8` (NULL: from the newest), at most `$9`. Keyset paging:
/// a page deep in millions of rows costs what the first does, where an `OFFSET` reads
/// every row it skips.
pub const MESSAGES_OLDER: &str = concat!(
    messages_columns!(),
    messages_where!(),
    "  AND ($8::int8 IS NULL OR id < $8::int8)\nORDER BY id DESC\nLIMIT $9\n"
);

/// Console: [`MESSAGES_OLDER`]'s way back: messages matching the same filters with an id
/// above `$8`, oldest first, at most `$9` (the page reverses them).
pub const MESSAGES_NEWER: &str = concat!(
    messages_columns!(),
    messages_where!(),
    "  AND id > $8::int8\nORDER BY id\nLIMIT $9\n"
);

/// Console: how many messages match the filters of `messages_where!` (`$1`..`$7`),
/// counting no further than `$8`: a count of everything would read every row, and the
/// page only needs "N match" or "more than N".
pub const MESSAGES_COUNT: &str = concat!(
    "SELECT count(*)::bigint FROM (SELECT 1 FROM outbox.messages",
    messages_where!(),
    "LIMIT $8) m\n"
);

/// The database's clock: pages say "3 min ago" from it, not from the console host's.
pub const DATABASE_NOW: &str = "SELECT now()";
