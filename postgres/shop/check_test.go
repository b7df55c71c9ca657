package shop

// The tests of the shop and the warehouse run with the outbox's, in the
// postgres package's tests, which drive the relay with them; this one needs
// insertOrder, which only the package can reach.

import (
	"context"
	"database/sql"
	"errors"
	"testing"

	"github.com/jackc/pgx/v5/pgconn"

	"example.com/patterns/enterprise/outbox/postgres"
	"example.com/patterns/enterprise/outbox/postgres/pgtest"
)

// A writer inside the package that skips checkTotal meets the orders
// table's CHECK, and gets the root package's error for it, with the
// server's below; nothing is written.
func TestInsertOrderTurnsTheTablesCheckIntoErrInvalidTotal(t *testing.T) {
	ctx := context.Background()
	db := pgtest.Open(t, pgtest.NewBlankDatabase(t), "")
	if err := Migrate(ctx, db); err != nil {
		t.Fatal(err)
	}
	err := postgres.Transaction(ctx, db, func(ctx context.Context, tx *sql.Tx) error {
		_, _, err := insertOrder(ctx, tx, sql.NullString{}, 0)
		return err
	})
	if pgErr := (*pgconn.PgError)(nil); !errors.Is(err, ErrInvalidTotal) || !errors.As(err, &pgErr) || pgErr.Code != "23514" {
		t.Errorf("insertOrder of a zero total = %v, want ErrInvalidTotal wrapping the check_violation", err)
	}
	var orders int
	if err := db.QueryRow(`SELECT count(*) FROM orders`).Scan(&orders); err != nil || orders != 0 {
		t.Errorf("orders holds %d rows (%v), want 0", orders, err)
	}
}

func TestMain(m *testing.M) { pgtest.Main(m) }

// A shop or warehouse made with no database answers each call with an
// error wrapping postgres.ErrInvalidConfig, not a panic, and writes
// nothing. (Caught: the outbox opened in each call, or never checked.)
func TestNoDatabaseIsAnErrorNotAPanic(t *testing.T) {
	ctx := context.Background()
	orders := NewOrderService(nil)
	if _, err := orders.PlaceOrder(ctx, 100); !errors.Is(err, postgres.ErrInvalidConfig) {
		t.Errorf("PlaceOrder on no database = %v, want ErrInvalidConfig", err)
	}
	if err := orders.CancelOrder(ctx, 1); !errors.Is(err, postgres.ErrInvalidConfig) {
		t.Errorf("CancelOrder on no database = %v, want ErrInvalidConfig", err)
	}
	w := NewWarehouse(nil)
	msg := postgres.Message{ID: 1, Key: "k", Type: OrderPlaced, Payload: `{"id":1,"totalCents":100}`}
	if applied, err := w.Handle(ctx, msg); applied || !errors.Is(err, postgres.ErrInvalidConfig) {
		t.Errorf("Handle on no database = %v, %v; want ErrInvalidConfig", applied, err)
	}
	if _, err := w.ForgetProcessed(ctx, 0, 0); !errors.Is(err, postgres.ErrInvalidConfig) {
		t.Errorf("ForgetProcessed on no database = %v, want ErrInvalidConfig", err)
	}
}
