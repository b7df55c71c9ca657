-- The tables of the outbox example on PostgreSQL. Every statement can run
-- again on a database that already has them.

-- The shop's table. The CHECK is the rule the root package's Tx.InsertOrder
-- stands for: a total is a positive number of cents. idempotency_key is the
-- caller's name for the request that placed the order (PlaceOrderWithKey), so
-- that a retry after a commit of unknown outcome finds the first order
-- instead of placing a second; NULL for orders placed without one (a unique
-- constraint lets NULLs repeat).
CREATE TABLE IF NOT EXISTS orders (
    id              bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    total_cents     bigint NOT NULL CHECK (total_cents > 0),
    idempotency_key text UNIQUE
);

-- The outbox: one row per event, written in the same transaction as the
-- change it reports. An id is taken from the identity's sequence when the row
-- is inserted, not when its transaction commits, and is never handed out
-- again, even after a rollback or a cleanup that deletes sent rows: consumers
-- drop duplicates by it. payload is json, not jsonb, so that it comes back
-- byte for byte as it was written: {"orderId":1,"totalCents":2500}.
CREATE TABLE IF NOT EXISTS outbox (
    id         bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    type       text        NOT NULL,
    payload    json        NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now(),
    sent_at    timestamptz             -- NULL until the broker has accepted the message
);

-- The relay's question, "the unsent rows in id order", reads this small index
-- and never the sent rows, however many of them the table keeps.
CREATE INDEX IF NOT EXISTS outbox_unsent ON outbox (id) WHERE sent_at IS NULL;

-- The consumer's side (the warehouse). In a real system these live in the
-- consumer's own database; here they share the server so that one test can
-- see both. processed_messages holds the id of every message the warehouse
-- has applied, written in the same transaction as its effect.
CREATE TABLE IF NOT EXISTS processed_messages (
    message_id bigint PRIMARY KEY
);

-- The warehouse's effect: one reservation per order it has heard of. Nothing
-- here stops a second reservation for the same order; processed_messages does.
CREATE TABLE IF NOT EXISTS reservations (
    id          bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    order_id    bigint NOT NULL,
    total_cents bigint NOT NULL
);
