-- Migration 8: a team's own headers, and payloads that are not JSON
-- (Event.Headers, Event.ContentType). headers holds the headers as a JSON
-- object of strings, NULL for none. A payload of another content type
-- (Protobuf, Avro) is bytes, which a json column cannot hold: it goes in
-- body, byte for byte, with its media type in content_type, and payload is
-- NULL; a JSON payload stays in payload, with body and content_type NULL.
-- The first check says each row has exactly one of the two; the second
-- that headers are an object of strings, so that a row written by hand
-- cannot hold a header a relay could not read. Existing rows are
-- kept as they are: adding columns without a default rewrites nothing,
-- dropping NOT NULL reads nothing, and NOT VALID checks the rows written
-- from now on without reading those already there (each has a payload).
ALTER TABLE outbox
    ADD COLUMN IF NOT EXISTS headers jsonb,
    ADD COLUMN IF NOT EXISTS body bytea,
    ADD COLUMN IF NOT EXISTS content_type text,
    ALTER COLUMN payload DROP NOT NULL;

ALTER TABLE outbox ADD CONSTRAINT outbox_payload_or_body
    CHECK ((payload IS NULL) <> (body IS NULL)) NOT VALID;

ALTER TABLE outbox ADD CONSTRAINT outbox_headers_strings
    CHECK (headers IS NULL OR (jsonb_typeof(headers) = 'object'
           AND NOT jsonb_path_exists(headers, '$.* ? (@.type() != "string")'))) NOT VALID;
