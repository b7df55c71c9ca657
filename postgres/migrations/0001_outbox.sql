-- Migration 1: the outbox's tables as they stood before migrations were
-- numbered. Every statement can run again on a database that already has
-- them, so a database made by the CreateTables of those versions takes it as
-- it is. The example's orders and reservations, which the same file held
-- then, are the shop package's migrations now.

-- The outbox: one row per event, written in the same transaction as the
-- change it reports. An id is taken from the identity's sequence when the row
-- is inserted, not when its transaction commits. payload is json, not jsonb,
-- so that it comes back byte for byte as it was written:
-- {"orderId":1,"totalCents":2500}.
--
-- message_key names the message where consumers meet: a random UUID, unique
-- across producers without any coordination, and not handed out again after
-- a sequence is reset or the database moves to a logical replica (which does
-- not copy sequence values), as ids can be. Consumers drop duplicates by it.
--
-- aggregate names what the event is about ('order/17') and seq is its number
-- among that aggregate's events (OrderPlaced 1, OrderCancelled 2): the
-- producer writes them under the aggregate's row lock, so one aggregate's
-- events commit in id order; a relay with PerAggregate publishes them in
-- that order, and a consumer can tell one that arrives before its
-- predecessor. NULL for an event that needs no order.
--
-- attempts, rejections and last_error are written by the relay pass that
-- failed to publish the row; parked_at by the pass that set it aside after
-- too many rejections (OutboxRelay.ParkAfter), so that it no longer holds
-- back the rows after it.
CREATE TABLE IF NOT EXISTS outbox (
    id          bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    message_key uuid        NOT NULL DEFAULT gen_random_uuid(),
    type        text        NOT NULL,
    payload     json        NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT now(),
    sent_at     timestamptz,            -- NULL until the broker has accepted the message
    attempts    integer     NOT NULL DEFAULT 0,  -- failed publishes, for any reason
    rejections  integer     NOT NULL DEFAULT 0,  -- of which the broker refused for ever (ErrRejected)
    last_error  text,
    parked_at   timestamptz,            -- set aside: no longer published, until Unpark
    aggregate   text,
    seq         bigint
);

-- The relay's question, "the rows still to publish, in id order", reads this
-- small index and never the sent or parked rows. A mark changes sent_at, a
-- column of the predicate, so it is never a HOT update: each leaves a dead
-- entry here that claims walk past until vacuum removes it.
CREATE INDEX IF NOT EXISTS outbox_unsent ON outbox (id) WHERE sent_at IS NULL AND parked_at IS NULL;

-- Parked rows, for ListParked and ReadLag; normally none.
CREATE INDEX IF NOT EXISTS outbox_parked ON outbox (id) WHERE parked_at IS NOT NULL AND sent_at IS NULL;

-- A relay with PerAggregate asks, for each row it would claim, whether an
-- earlier row of its aggregate is still unsent; this answers it.
CREATE INDEX IF NOT EXISTS outbox_unsent_by_aggregate ON outbox (aggregate, id) WHERE sent_at IS NULL;

-- Autovacuum for a queue. By default a table is vacuumed once a fifth of it
-- is dead (scale factor 0.2), which for an outbox that keeps a week of sent
-- rows means almost never, while every mark leaves a dead entry in
-- outbox_unsent for the claim to walk past. These make autovacuum take the
-- outbox after every 5,000 dead rows whatever its size, without the cost
-- delay that paces it. How soon it looks is the server's
-- autovacuum_naptime (1 min by default; lower it on a busy outbox).
ALTER TABLE outbox SET (
    autovacuum_vacuum_scale_factor = 0,
    autovacuum_vacuum_threshold = 5000,
    autovacuum_vacuum_cost_delay = 0
);

-- NOTIFY outbox at the commit of every transaction that inserted an outbox
-- row, whoever wrote it: PostgreSQL delivers a notification only when its
-- transaction commits, never before and never for one rolled back, and
-- folds a transaction's identical notifications into one. OutboxRelay.Run
-- listens on the channel.
CREATE OR REPLACE FUNCTION outbox_notify() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('outbox', '');
    RETURN NULL;
END
$$;
CREATE OR REPLACE TRIGGER outbox_notify AFTER INSERT ON outbox
    FOR EACH STATEMENT EXECUTE FUNCTION outbox_notify();

-- The consumer's side (ApplyOnce). In a real system these live in the
-- consumer's own database. processed_messages holds the key of every message
-- the consumer has applied, written in the same transaction as its effect;
-- processed_at lets ForgetProcessed delete old keys in batches.
CREATE TABLE IF NOT EXISTS processed_messages (
    message_key  text        PRIMARY KEY,
    processed_at timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX IF NOT EXISTS processed_messages_at ON processed_messages (processed_at);

-- The seq of the last event the consumer applied for each aggregate, so that
-- it can refuse one that arrives before its predecessor.
CREATE TABLE IF NOT EXISTS aggregate_positions (
    aggregate text   PRIMARY KEY,
    seq       bigint NOT NULL
);
