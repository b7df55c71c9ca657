-- Migration 10: what cleanup cut. outbox_cleanup holds one row, whose
-- deleted_through is the newest created_at of any sent row deleted from
-- outbox: by DeleteSent, or by a log relay's marks that delete what it
-- delivered (LogRelayConfig.DeleteDelivered), in the statement that deletes
-- it. Replay refuses a range that begins at or before it (ErrNotKept),
-- since rows written then may be gone, whatever the table still holds from
-- then: one old row not yet sent (scheduled, parked, failing) used to let
-- such a replay through, to put back what was left and say nothing of the
-- rest.
--
-- What a cleanup before this migration cut was not recorded: on a table
-- whose identity has handed out an id, deleted_through starts at the
-- migration's time, so a range replay of what was written before it is
-- refused; a replay by aggregate still checks the aggregate's own rows.
-- On a new table it starts at -infinity.
CREATE TABLE IF NOT EXISTS outbox_cleanup (
    only_row        boolean PRIMARY KEY DEFAULT true CHECK (only_row),
    deleted_through timestamptz NOT NULL
);

INSERT INTO outbox_cleanup (deleted_through)
SELECT CASE WHEN pg_sequence_last_value(pg_get_serial_sequence('outbox', 'id')) IS NULL
            THEN '-infinity'::timestamptz ELSE clock_timestamp() END
ON CONFLICT DO NOTHING;
