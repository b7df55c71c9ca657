-- Migration 4: the publication the log relay (LogRelay) reads, through its
-- replication slot: the outbox's inserts, and nothing else (no update, no
-- delete, no other table). A publication costs nothing while no slot reads
-- it. CREATE PUBLICATION has no IF NOT EXISTS, hence the test. It needs
-- CREATE on the database, which only log mode needs: a migrator without it
-- (a polling deployment's) skips it, and Outbox.CreateLogSlot makes it.
DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_publication WHERE pubname = 'outbox_inserts')
        AND has_database_privilege(current_database(), 'CREATE') THEN
        CREATE PUBLICATION outbox_inserts FOR TABLE outbox WITH (publish = 'insert');
    END IF;
END
$$;
