-- Migration 7: a time to deliver. deliver_at, when set, is the earliest
-- time the row may go to the broker (Event.DeliverAt): until then it is
-- scheduled, and no relay claims it. It is kept out of outbox_unsent, so
-- that the claim's walk never meets the rows that wait for the future,
-- however many there are; and it is in outbox_held, so that a relay with
-- order per aggregate passes over the later rows of its aggregate, which
-- wait behind it. Each pass's claim first releases the rows whose time has
-- come (outbox_scheduled finds them): it clears deliver_at, which puts them
-- in outbox_unsent, in their place by id, and the trigger below notifies
-- the relays as an insert does, so Run claims them at once. NULL for every
-- row written without a time, and for a scheduled row once released.
--
-- The two indexes are made again with the column in their predicates: each
-- CREATE INDEX reads the whole table and blocks its writes while it does,
-- and the relays' claims wait for this migration's transaction. On a large
-- outbox, run it in a quiet moment. A query of your own that reads the
-- unsent rows through outbox_unsent must now say deliver_at IS NULL too, or
-- the server no longer uses the index for it.
ALTER TABLE outbox ADD COLUMN IF NOT EXISTS deliver_at timestamptz;

DROP INDEX IF EXISTS outbox_unsent;
CREATE INDEX outbox_unsent ON outbox (id)
    WHERE sent_at IS NULL AND parked_at IS NULL AND deliver_at IS NULL;

DROP INDEX IF EXISTS outbox_held;
CREATE INDEX outbox_held ON outbox (aggregate, id)
    WHERE sent_at IS NULL AND (parked_at IS NOT NULL OR attempts > 0 OR deliver_at IS NOT NULL);

CREATE INDEX IF NOT EXISTS outbox_scheduled ON outbox (deliver_at)
    WHERE sent_at IS NULL AND deliver_at IS NOT NULL;

CREATE OR REPLACE TRIGGER outbox_released AFTER UPDATE OF deliver_at ON outbox
    FOR EACH ROW WHEN (OLD.deliver_at IS NOT NULL AND NEW.deliver_at IS NULL)
    EXECUTE FUNCTION outbox_notify();
