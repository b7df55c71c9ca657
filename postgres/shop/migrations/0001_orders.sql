-- Migration 1 of the example: the shop's orders and the warehouse's
-- reservations, as they stood before migrations were numbered (the outbox's
-- own migration 1 held them then), so every statement can run again on a
-- database that already has them.

-- The shop's table. The CHECK is the rule the root package's Tx.InsertOrder
-- stands for: a total is a positive number of cents. idempotency_key is the
-- caller's name for the request that placed the order (PlaceOrderWithKey), so
-- that a retry after a commit of unknown outcome finds the first order
-- instead of placing a second; NULL for orders placed without one (a unique
-- constraint lets NULLs repeat). events counts the events written for the
-- order, the last one's seq (see the outbox); cancelled_at is set by
-- CancelOrder.
CREATE TABLE IF NOT EXISTS orders (
    id              bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    total_cents     bigint NOT NULL CHECK (total_cents > 0),
    idempotency_key text UNIQUE,
    events          integer NOT NULL DEFAULT 1,
    cancelled_at    timestamptz
);

-- The warehouse's effect: one reservation per order it has heard of. Nothing
-- here stops a second reservation for the same order; processed_messages does.
CREATE TABLE IF NOT EXISTS reservations (
    id          bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    order_id    bigint NOT NULL,
    total_cents bigint NOT NULL
);

