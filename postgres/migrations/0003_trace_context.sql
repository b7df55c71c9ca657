-- Migration 3: the trace context of the transaction that wrote a row, so
-- that the relay's publish, and the consumer after it, join the trace of the
-- request that made the change. InsertOutbox writes the W3C headers of its
-- context's span (traceparent, and tracestate if any) as a JSON object, such
-- as {"traceparent":"00-4bf9…-00f0…-01"}; NULL when the context carries no
-- span. A column with no default: adding it rewrites nothing.
ALTER TABLE outbox ADD COLUMN IF NOT EXISTS trace_context json;
