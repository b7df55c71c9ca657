package postgres

import (
	"context"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5"
)

// Queue queues the insert of e's outbox row into b, for a team on pgx that
// sends its own statements and the event in one round trip instead of
// two: send b in the transaction that makes the business change
// (tx.SendBatch), and the row commits or rolls back with it, as Write's
// does. id, if not nil, is set to the row's id when the batch's results
// are read (BatchResults.Close, or its Exec and QueryRow in order). ctx
// carries the trace context the row stores, as Write's does.
//
// Queue refuses, with Write's errors and queueing nothing, an event Write
// refuses; and a nil batch.
func (o *Outbox[T]) Queue(ctx context.Context, b *pgx.Batch, e Event, id *int64) error {
	if err := o.usable(); err != nil {
		return err
	}
	if b == nil {
		return errors.New("postgres: Queue: no batch")
	}
	query, args, err := o.t.statement(ctx, e)
	if err != nil {
		return err
	}
	table := o.t.table
	b.Queue(query, args...).QueryRow(func(row pgx.Row) error {
		var got int64
		if err := row.Scan(&got); err != nil {
			return fmt.Errorf("insert into %s: %w", table, err)
		}
		if id != nil {
			*id = got
		}
		return nil
	})
	return nil
}
