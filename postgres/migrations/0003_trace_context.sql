-- Migration 3: the trace context of the transaction that wrote a row, so
-- that the relay's publish, and the consumer after it, join the trace of the
-- request that made the change. InsertOutbox writes the W3C Trace Context
-- headers of its context's span as they go on the wire: traceparent
-- ('00-4bf9…-00f0…-01') and tracestate (vendors' entries, NULL if none);
-- both NULL when the context carries no span. Columns with no default:
-- adding them rewrites nothing.
ALTER TABLE outbox
    ADD COLUMN IF NOT EXISTS traceparent text,
    ADD COLUMN IF NOT EXISTS tracestate  text;
