-- outboxd schema, version 11: purge takes cancelled rows too.
--
-- A cancelled message is finished like a delivered one: it will never be sent, and its row
-- is only the key's dedup record (and the cancel's history). Until now neither
-- `outboxd purge` nor the daemon's retention deleted it, so a site that cancels routinely
-- grew the table for ever. Cancelled rows now go with delivered ones, by `cancelled_at`,
-- through messages_cancelled_idx (sql/0009). Same signature, same rules.
CREATE OR REPLACE FUNCTION outbox.purge(older_than interval, include_dead boolean DEFAULT false, batch_size integer DEFAULT 1000)
RETURNS bigint
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_deleted bigint;
BEGIN
    IF older_than IS NULL OR older_than < interval '24 hours' THEN
        RAISE EXCEPTION 'older_than must be at least 24 hours' USING ERRCODE = '22023', COLUMN = 'older_than';
    END IF;
    IF batch_size IS NULL OR batch_size < 1 THEN
        RAISE EXCEPTION 'batch_size must be at least 1' USING ERRCODE = '22023', COLUMN = 'batch_size';
    END IF;
    WITH old_delivered AS (
        SELECT m.id FROM outbox.messages m
        WHERE m.state = 'delivered' AND m.delivered_at < now() - older_than
        ORDER BY m.delivered_at LIMIT batch_size FOR UPDATE SKIP LOCKED
    ), old_cancelled AS (
        SELECT m.id FROM outbox.messages m
        WHERE m.state = 'cancelled' AND m.cancelled_at < now() - older_than
        ORDER BY m.cancelled_at LIMIT batch_size FOR UPDATE SKIP LOCKED
    ), old_dead AS (
        SELECT m.id FROM outbox.messages m
        WHERE include_dead AND m.state = 'dead' AND m.dead_at < now() - older_than
        ORDER BY m.dead_at LIMIT batch_size FOR UPDATE SKIP LOCKED
    ), gone AS (
        DELETE FROM outbox.messages m
        WHERE m.id IN (SELECT id FROM old_delivered
                       UNION ALL SELECT id FROM old_cancelled
                       UNION ALL SELECT id FROM old_dead)
        RETURNING 1
    )
    SELECT count(*) INTO v_deleted FROM gone;
    RETURN v_deleted;
END
$$;
