-- outboxd schema, version 8: the lease-expiry rule in one SQL place.
--
-- An expired lease means the attempt's outcome is unknown: an ambiguous failure. What
-- follows is decide()'s rule for an ambiguous failure (src/state.rs): retried (the row goes
-- on) only when the message allows ambiguous retries and the attempt that expired was not the
-- last of the budget; otherwise dead, class ambiguous. queries::CLAIM asks this function
-- instead of restating the rule, and tests/leases.rs checks it against decide() over a table
-- of (retry_ambiguous, attempts, max_attempts). Like every function since 0007, it runs
-- with a pinned search_path.
CREATE FUNCTION outbox.on_lease_expiry(retry_ambiguous boolean, attempts integer, max_attempts integer)
RETURNS text
LANGUAGE sql
IMMUTABLE
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT CASE WHEN retry_ambiguous AND attempts < max_attempts THEN 'pending' ELSE 'dead' END
$$;
