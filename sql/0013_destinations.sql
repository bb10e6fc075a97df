-- outboxd schema, version 13: a message's destination (issue 18, parts 1 to 3).
--
-- Limits per destination (`--host-concurrency`, rate limits, circuit breakers) need one name
-- for "where this message goes" that the worker, the claim and an operator agree on. It is
-- computed from the payload, never stored: a stored column would cost a trigger on every
-- enqueue, and an index on it a write on every change of state, for a name that only the
-- rules per destination read.
--
-- outbox.destination_of(channel, payload): for a webhook, its URL's host in lower case, with
-- `:port` when the URL names a port other than its scheme's default (80 for http, 443 for
-- https); NULL for other channels and for a URL this cannot read (the worker then applies no
-- rule per destination, and refuses the URL itself as invalid if it is one). User
-- information before an `@` is skipped (it is a credential, never part of the name). An IPv6
-- literal keeps its brackets; a trailing dot is dropped (`example.com.` is `example.com`).
-- Only the authority is read, so the name never holds a path or a query. A host holding
-- whitespace or a control character is no name (NULL).

CREATE FUNCTION outbox.destination_of(channel text, payload jsonb)
RETURNS text
LANGUAGE sql
IMMUTABLE
PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT CASE
        WHEN p[2] IS NULL OR p[2] = '' THEN NULL
        WHEN p[3] IS NULL
          OR (lower(p[1]) = 'http' AND p[3]::int = 80)
          OR (lower(p[1]) = 'https' AND p[3]::int = 443) THEN rtrim(lower(p[2]), '.')
        ELSE rtrim(lower(p[2]), '.') || ':' || p[3]::int::text
    END
    FROM (SELECT CASE WHEN channel = 'webhook' AND jsonb_typeof(payload -> 'url') = 'string'
                      THEN regexp_match(payload ->> 'url',
                          '^([A-Za-z][A-Za-z0-9+.-]*)://(?:[^/?#]*@)?(\[[0-9A-Fa-f:.]+\]|[^][/?#:@\s[:cntrl:]]+)(?::([0-9]{1,5}))?(?:[/?#]|$)')
                 END AS p) m
$$;
