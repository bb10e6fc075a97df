-- outboxd schema, version 10: reconciliation in the lease-expiry rule.
--
-- A webhook whose payload names a lookup (`reconcile.url`) settles an ambiguous outcome by
-- asking the provider, which is safe to repeat: its next attempt sends GET reconcile.url
-- first and sends the request again only when the provider answers 404 or 410. So for such
-- a message an ambiguous outcome with budget left goes on to that attempt even when
-- `retry_ambiguous` is false; decide() says so through Budget.reconcile (src/state.rs).
--
-- An expired lease is an ambiguous outcome too, decided in SQL by the claim: this overload of
-- outbox.on_lease_expiry (0008) takes the fourth fact, and outbox.reconcilable is the one
-- statement of "names a lookup", which the claim also returns to the worker (Claimed.reconcile),
-- so the SQL path and the Rust path read the payload the same way. tests/it/leases.rs checks
-- the function against decide() over a table of (retry_ambiguous, reconcile, attempts,
-- max_attempts). The three-argument function stays for anyone who calls it.
CREATE FUNCTION outbox.on_lease_expiry(retry_ambiguous boolean, attempts integer,
                                       max_attempts integer, reconcile boolean)
RETURNS text
LANGUAGE sql
IMMUTABLE
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT CASE WHEN (retry_ambiguous OR coalesce(reconcile, false)) AND attempts < max_attempts
                THEN 'pending' ELSE 'dead' END
$$;

-- Does a message name a reconciliation lookup? A webhook whose payload has a string
-- `reconcile.url` (enqueue refuses any other shape since 0009; rows stored before it are read
-- the same way, and the worker refuses a malformed one as invalid).
CREATE FUNCTION outbox.reconcilable(channel text, payload jsonb)
RETURNS boolean
LANGUAGE sql
IMMUTABLE
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT channel = 'webhook'
       AND jsonb_typeof(payload -> 'reconcile' -> 'url') IS NOT DISTINCT FROM 'string'
$$;
