-- The consumer's set, migration 1: the tables a consumer keeps
-- (ApplyOnce, ApplyBatch), in the consumer's own database, and nothing of
-- the outbox's. Recorded in outbox_consumer_migrations, apart from any
-- outbox's record, and applied by Outbox.MigrateConsumer.
--
-- Every consumer of the database keeps its records here under its own
-- name (Config.Consumer, '' for the default one). A database whose outbox
-- migrations made these tables already (the outbox's migrations 1, 2 and 9
-- make them too, for a service that is both) takes this migration as it
-- is: every statement leaves what is there, and brings a table made before
-- the outbox's migration 9 to the same shape.

-- The key of every message the consumer applied, written in the same
-- transaction as its effect; processed_at lets ForgetProcessed delete old
-- keys in batches.
CREATE TABLE IF NOT EXISTS processed_messages (
    consumer     text        NOT NULL DEFAULT '',
    message_key  text        NOT NULL,
    processed_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer, message_key)
);
CREATE INDEX IF NOT EXISTS processed_messages_at ON processed_messages (processed_at);

-- The seq of the last event the consumer applied for each aggregate, so
-- that it can refuse one that arrives before its predecessor; applied_at
-- is when it last moved, closed set once the aggregate's last event was
-- applied, so that ForgetProcessed may forget it after its retention.
CREATE TABLE IF NOT EXISTS aggregate_positions (
    consumer   text        NOT NULL DEFAULT '',
    aggregate  text        NOT NULL,
    seq        bigint      NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now(),
    closed     boolean     NOT NULL DEFAULT false,
    PRIMARY KEY (consumer, aggregate)
);

-- Tables made before the outbox's migrations 2 and 9: their columns, and
-- the primary keys with the consumer's name in front; then the index of
-- the closed positions, once there is a column closed.
ALTER TABLE aggregate_positions
    ADD COLUMN IF NOT EXISTS applied_at timestamptz NOT NULL DEFAULT now(),
    ADD COLUMN IF NOT EXISTS closed     boolean     NOT NULL DEFAULT false;
ALTER TABLE processed_messages ADD COLUMN IF NOT EXISTS consumer text NOT NULL DEFAULT '';
ALTER TABLE aggregate_positions ADD COLUMN IF NOT EXISTS consumer text NOT NULL DEFAULT '';
DO $$
BEGIN
    IF (SELECT cardinality(conkey) FROM pg_constraint
        WHERE conrelid = 'processed_messages'::regclass AND contype = 'p') = 1 THEN
        ALTER TABLE processed_messages DROP CONSTRAINT processed_messages_pkey,
            ADD CONSTRAINT processed_messages_pkey PRIMARY KEY (consumer, message_key);
    END IF;
    IF (SELECT cardinality(conkey) FROM pg_constraint
        WHERE conrelid = 'aggregate_positions'::regclass AND contype = 'p') = 1 THEN
        ALTER TABLE aggregate_positions DROP CONSTRAINT aggregate_positions_pkey,
            ADD CONSTRAINT aggregate_positions_pkey PRIMARY KEY (consumer, aggregate);
    END IF;
END
$$;
CREATE INDEX IF NOT EXISTS aggregate_positions_closed ON aggregate_positions (applied_at) WHERE closed;
