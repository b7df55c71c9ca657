package postgres

import (
	"context"
	"database/sql"
)

// This file is compiled only into the package's tests. It lets them reach
// one unexported seam without adding API that callers could see.

// InsertOrder is insertOrder with no idempotency key: the orders insert
// without checkTotal in front of it, so that a test can meet the table's
// CHECK.
func InsertOrder(ctx context.Context, tx *sql.Tx, totalCents int64) (int64, error) {
	order, _, err := insertOrder(ctx, tx, sql.NullString{}, totalCents)
	return order.ID, err
}
