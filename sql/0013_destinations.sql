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
-- rule per destination, and refuses the URL itself as invalid if it is one). The rules,
-- which `claim::destination_of` in the worker follows exactly (tests/it/destinations.rs
-- checks the two agree):
--   * the URL starts with a scheme and `://`; the authority runs to the first `/`, `?` or
--     `#`; user information, up to the last `@`, is dropped (it is a credential, never part
--     of the name); the rest is lower-cased;
--   * the host is letters, digits, `.`, `-` and `_` (an internationalised name in its
--     `xn--` form), or an IPv6 literal in brackets; a trailing dot is dropped
--     (`example.com.` is `example.com`); anything else is no name (NULL);
--   * a port is 1 to 5 digits, written back without leading zeros.
-- Only the authority is read, so the name never holds a path or a query.
--
-- The worker does not call this per claimed row: it costs about 20 µs a call (a function
-- with a pinned search_path is never inlined, and PostgreSQL's string functions are slow at
-- this), more than the claim's whole per-row work; the worker reads the name from the
-- payload it has already fetched (`claim::destination_of`, the same rules). It is here for
-- operators and for statements that pick rows by destination, off the hot path.

CREATE FUNCTION outbox.destination_of(channel text, payload jsonb)
RETURNS text
LANGUAGE plpgsql
IMMUTABLE
PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    url text;
    scheme text;
    auth text;
    host text;
    port text;
BEGIN
    IF channel <> 'webhook' OR jsonb_typeof(payload -> 'url') IS DISTINCT FROM 'string' THEN
        RETURN NULL;
    END IF;
    url := payload ->> 'url';
    IF url !~ '^[A-Za-z][A-Za-z0-9+.-]*://' THEN
        RETURN NULL;
    END IF;
    scheme := lower(split_part(url, '://', 1));
    -- The authority: up to the first '/', '?' or '#', after the last '@'.
    auth := substr(url, length(scheme) + 4);
    auth := split_part(split_part(split_part(split_part(auth, '/', 1), '?', 1), '#', 1), '@', -1);
    -- Checked before lower-casing: lower() maps some non-ASCII letters to ASCII ones (the
    -- Kelvin sign to `k`), which would give a name the worker does not.
    IF auth !~ '^(?:[A-Za-z0-9._-]+|\[[0-9A-Fa-f:.]+\])(?::[0-9]{1,5})?$' THEN
        RETURN NULL;
    END IF;
    auth := lower(auth);
    IF left(auth, 1) = '[' THEN
        host := split_part(auth, ']', 1) || ']';
        port := ltrim(split_part(auth, ']', 2), ':');
    ELSE
        host := rtrim(split_part(auth, ':', 1), '.');
        port := split_part(auth, ':', 2);
    END IF;
    IF host = '' THEN
        RETURN NULL;
    ELSIF port = '' OR (scheme = 'http' AND port::int = 80) OR (scheme = 'https' AND port::int = 443) THEN
        RETURN host;
    END IF;
    RETURN host || ':' || port::int::text;
END
$$;
