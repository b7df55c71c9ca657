-- Migration 2: a consumer's positions can be forgotten once their aggregate
-- is over. applied_at is when the position last moved; closed is set when
-- ApplyOnce applied the aggregate's last event (the caller says which one
-- is last: the example's OrderCancelled, since an order cancelled cannot be
-- cancelled again). ForgetProcessed deletes the closed positions older than
-- its retention, as it deletes old keys. An open aggregate's position is
-- kept: forgotten, its next event would be refused as out of order for ever.
-- Both columns get a constant default, so adding them rewrites nothing.
ALTER TABLE aggregate_positions
    ADD COLUMN IF NOT EXISTS applied_at timestamptz NOT NULL DEFAULT now(),
    ADD COLUMN IF NOT EXISTS closed     boolean     NOT NULL DEFAULT false;
CREATE INDEX IF NOT EXISTS aggregate_positions_closed ON aggregate_positions (applied_at) WHERE closed;
