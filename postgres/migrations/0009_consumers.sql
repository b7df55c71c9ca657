-- Migration 9: a consumer's records are its own (Config.Consumer). Two
-- consumers of the same events in one database, a mailer beside the
-- billing, each record the keys they applied and the positions of
-- the aggregates they follow under their own name: before, the second
-- found the first's records and dropped every message as a copy. Every
-- record already kept becomes the default consumer's (''), which is what
-- an Outbox opened without a Consumer reads and writes, so a consumer
-- that ran before this migration goes on where it was.
--
-- Adding a column with a constant default rewrites nothing. Each primary
-- key is made again with the name in front, once (two outboxes of one
-- database both run this migration): that builds its index, holding the
-- table against the consumers' writes while it reads the rows, which
-- ForgetProcessed keeps few.
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
