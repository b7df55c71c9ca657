-- Migration 11: a NOTIFY only while no relay is awake. A commit that
-- notified takes a lock for the whole server (PreCommit_Notify in
-- PostgreSQL's async.c), so notifying commits happen one at a time: with 32
-- producers the outbox placed a third of the orders a second the order
-- alone did (make measure-write). A relay needs a notification only to wake
-- up; while it passes, it sees the rows anyway.
--
-- So outbox_awake says whether a relay is awake: 1 while one passes and
-- will pass again, 0 (its start) when none is. It is a sequence, whose
-- value every session sees at once, in no transaction. Each transaction
-- that writes a row holds the advisory lock (outbox, 2) shared until it
-- ends, and then notifies only if no relay is awake. A relay that goes to
-- sleep first sets 0, then takes the lock (outbox, 2) once, which it gets
-- only when no such transaction is open, and then passes once more: a
-- transaction that read 1 had committed before that pass; any later one
-- reads 0 and notifies. A relay that finds a transaction still open stays
-- awake, and passes again soon.
--
-- A relay that stops sets 0; one that dies leaves 1 until another relay's
-- next poll, which sets it right. A relay that does not keep the flag (the
-- log relay, PollOnly, an older version) leaves 0, and every transaction
-- notifies, as before.
CREATE SEQUENCE IF NOT EXISTS outbox_awake MINVALUE 0 MAXVALUE 1 START 0 NO CYCLE;

CREATE OR REPLACE FUNCTION outbox_notify() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_advisory_xact_lock_shared(hashtext('outbox'), 2);
    IF (SELECT last_value FROM outbox_awake) = 0 THEN
        PERFORM pg_notify('outbox', '');
    END IF;
    RETURN NULL;
END
$$;
