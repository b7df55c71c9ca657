-- Migration 5: the rows that hold back their aggregate for a relay with
-- PerAggregate: unsent rows that are parked, or whose publish failed
-- (attempts > 0). Such a relay claims an aggregate's rows as a run from its
-- first unsent one, and passes over every row of an aggregate with a held row
-- before it; this index answers "is there one?" in one lookup, whatever the
-- aggregate's backlog. It is normally empty. CREATE INDEX reads the whole
-- table and blocks its writes while it does: on a large outbox, run it by
-- hand first as CREATE INDEX CONCURRENTLY with the same name, and this
-- migration then finds it made.
CREATE INDEX IF NOT EXISTS outbox_held ON outbox (aggregate, id)
    WHERE sent_at IS NULL AND (parked_at IS NOT NULL OR attempts > 0);
