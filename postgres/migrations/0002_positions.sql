-- The warehouse's positions can be forgotten once their aggregate is over.
-- applied_at is when the position last moved; closed is set when the
-- warehouse applied its aggregate's last event (an order's OrderCancelled:
-- CancelOrder refuses an order cancelled already, so no event follows it).
-- Warehouse.ForgetProcessed deletes the closed positions older than its
-- retention, as it deletes old keys. An open aggregate's position is kept:
-- forgotten, its next event would be refused as out of order for ever.
-- Both columns get a constant default, so adding them rewrites nothing.
ALTER TABLE aggregate_positions
    ADD COLUMN IF NOT EXISTS applied_at timestamptz NOT NULL DEFAULT now(),
    ADD COLUMN IF NOT EXISTS closed     boolean     NOT NULL DEFAULT false;
CREATE INDEX IF NOT EXISTS aggregate_positions_closed ON aggregate_positions (applied_at) WHERE closed;
