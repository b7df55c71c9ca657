package peerbench_test

import (
	"context"
	"database/sql"
	"fmt"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/components/forwarder"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"example.com/patterns/enterprise/outbox/postgres"
	"example.com/patterns/enterprise/outbox/postgres/pgtest"
	"example.com/patterns/enterprise/outbox/postgres/shop"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

// backlogs are the sizes of the drains, in orders: PEERBENCH_ORDERS, a
// comma-separated list, or 5,000 and 20,000. Watermill's forwarder reads, for
// every batch, each message past its consumer group's offset (see
// BenchmarkDrain), so its rate falls as its backlog grows while the relay's
// does not: the ratios hold for a backlog, so the figures give a short one
// and a long one.
var backlogs = []int{2000, 5000, 20000}

func init() {
	if v := os.Getenv("PEERBENCH_ORDERS"); v != "" {
		backlogs = nil
		for _, f := range strings.Split(v, ",") {
			var n int
			if _, err := fmt.Sscan(f, &n); err != nil || n <= 0 {
				panic("PEERBENCH_ORDERS must be positive numbers separated by commas, not " + v)
			}
			backlogs = append(backlogs, n)
		}
	}
}

// BenchmarkDrain drains the same backlog, orders placed one transaction
// each (the order's row and its message), with each contender in turn, to
// a broker that keeps only a count, reading at most 100 rows a query, for
// each of the backlogs (orders=N). It reports each one's messages a second
// (from its first pass to its last message) and their ratios (to
// watermill's, and in percent to a bare loop's: each relay's to the loop of
// its own statements, those loops' to the least), so that a round's
// contenders are compared under the same load of the machine.
//
// The contenders: relay is NewOutboxRelay as it comes (database/sql,
// PerAggregate); relay-pgx the same on a pgxpool.Pool; relay-table the
// relay over the whole table (PerAggregate off); bare-relay and bare-table
// the statements relay and relay-table send in this drain (BEGIN, the
// claim, the mark, COMMIT), the claim's text as the relay sent it
// (captured by a pgx tracer), on one pgx connection with nothing else;
// bare-pgx the two statements the article's relay needs and no more, the
// same way (the claim, FOR UPDATE SKIP LOCKED, and the mark); each bare
// loop also reports the time of its claim and its mark, round trip
// included, a pass; and watermill watermill-sql's
// forwarder (v4, its default PostgreSQL schema and offsets, polling every
// 10 ms) to an in-memory gochannel. With -test.v it logs the plan of
// watermill's query for a batch as its drain begins (EXPLAIN ANALYZE,
// BUFFERS): it gathers every message past the offset, and sorts them, to
// return the first 100.
//
// Each drains a database of its own, dropped after it. Setup is not timed;
// before each drain the server checkpoints and no autovacuum worker runs.
// ns/op is the seven drains together: read the rates. make
// measure-watermill runs it in rounds.
func BenchmarkDrain(b *testing.B) {
	for _, orders := range backlogs {
		b.Run(fmt.Sprintf("orders=%d", orders), func(b *testing.B) {
			rate := map[string]float64{}
			for _, kind := range []string{"relay", "relay-pgx", "relay-table", "bare-relay", "bare-table", "bare-pgx", "watermill"} {
				b.StopTimer()
				withDatabase(b, func(name string, db *sql.DB) {
					if kind == "watermill" {
						rate[kind] = drainWatermill(b, db, orders)
					} else {
						rate[kind] = drainOurs(b, name, db, kind, orders)
					}
				})
				b.ReportMetric(rate[kind], kind+"-msgs/s")
			}
			for _, kind := range []string{"relay", "relay-pgx", "relay-table", "bare-relay", "bare-table", "bare-pgx"} {
				b.ReportMetric(rate[kind]/rate["watermill"], kind+"/watermill")
			}
			// Each relay against the bare loop of its own statements, and
			// those against the least.
			for kind, bare := range map[string]string{"relay": "bare-relay", "relay-pgx": "bare-relay", "relay-table": "bare-table", "bare-relay": "bare-pgx", "bare-table": "bare-pgx"} {
				b.ReportMetric(100*rate[kind]/rate[bare], kind+"/"+bare+"-%")
			}
		})
	}
}

// withDatabase runs fn on a new, empty database of the tests' server, and
// drops it after.
func withDatabase(b *testing.B, fn func(name string, db *sql.DB)) {
	ctx := context.Background()
	admin := pgtest.Open(b, pgtest.Config.Database, "")
	name := fmt.Sprintf("peerbench_%d", os.Getpid())
	if _, err := admin.ExecContext(ctx, "CREATE DATABASE "+name); err != nil {
		b.Fatal(err)
	}
	defer func() {
		if _, err := admin.ExecContext(ctx, "DROP DATABASE "+name+" WITH (FORCE)"); err != nil {
			b.Error(err)
		}
	}()
	db := pgtest.Open(b, name, "")
	defer db.Close()
	fn(name, db)
}

// counted is a postgres.MessageBroker that keeps only how many messages it
// accepted.
type counted struct{ n atomic.Int64 }

func (c *counted) Publish(ctx context.Context, _ postgres.Message) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	c.n.Add(1)
	return nil
}

// drainOurs places that many orders in db, the database named, and drains
// them with kind, returning its rate.
func drainOurs(b *testing.B, name string, db *sql.DB, kind string, orders int) float64 {
	ctx := context.Background()
	ob, err := postgres.OpenDB(db, postgres.Config{})
	if err != nil {
		b.Fatal(err)
	}
	if err := ob.Migrate(ctx); err != nil {
		b.Fatal(err)
	}
	if err := shop.Migrate(ctx, db); err != nil {
		b.Fatal(err)
	}
	claimSQL := leastClaim
	if kind == "bare-relay" || kind == "bare-table" {
		claimSQL = relaysClaim(b, name, kind == "bare-relay") // while the outbox is empty: its pass publishes nothing
	}
	orderService := shop.NewOrderService(db)
	for i := range orders {
		if _, err := orderService.PlaceOrder(ctx, int64(100+i)); err != nil {
			b.Fatal(err)
		}
	}
	quiet(b, db)
	broker := &counted{}
	var pass func() (int, error)
	switch kind {
	case "relay", "relay-table":
		relay, err := ob.NewRelay(broker, postgres.RelayConfig{WholeTable: kind == "relay-table"})
		if err != nil {
			b.Fatal(err)
		}
		pass = func() (int, error) { return relay.PublishPending(ctx) }
	case "relay-pgx":
		p := newPool(b, name, nil)
		defer p.Close()
		relay, err := openOutbox(b, p).NewRelay(broker, postgres.RelayConfig{})
		if err != nil {
			b.Fatal(err)
		}
		pass = func() (int, error) { return relay.PublishPending(ctx) }
	case "bare-relay", "bare-table", "bare-pgx":
		cfg := pgtest.Config.Copy()
		cfg.Database = name
		conn, err := pgx.ConnectConfig(ctx, cfg)
		if err != nil {
			b.Fatal(err)
		}
		defer conn.Close(ctx)
		bare := &barePass{conn: conn, broker: broker, claimSQL: claimSQL, relayColumns: kind != "bare-pgx"}
		pass = func() (int, error) { return bare.pass(ctx) }
		defer func() {
			b.ReportMetric(float64(bare.claim.Microseconds())/float64(bare.passes), kind+"-claim-µs/pass")
			b.ReportMetric(float64(bare.mark.Microseconds())/float64(bare.passes), kind+"-mark-µs/pass")
		}()
	}
	b.StartTimer()
	start := time.Now()
	for broker.n.Load() < int64(orders) {
		if n, err := pass(); err != nil || n == 0 {
			b.Fatalf("%s: pass = %d, %v, with %d of %d messages published", kind, n, err, broker.n.Load(), orders)
		}
	}
	elapsed := time.Since(start)
	b.StopTimer()
	return float64(orders) / elapsed.Seconds()
}

// newPool is a pool of at most four connections to the database named,
// one of them connected, whose queries tracer sees, if not nil.
func newPool(b *testing.B, name string, tracer pgx.QueryTracer) *pgxpool.Pool {
	cfg, err := pgxpool.ParseConfig("")
	if err != nil {
		b.Fatal(err)
	}
	cfg.ConnConfig = pgtest.Config.Copy()
	cfg.ConnConfig.Database, cfg.ConnConfig.Tracer = name, tracer
	cfg.MaxConns = 4
	p, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		b.Fatal(err)
	}
	if err := p.Ping(context.Background()); err != nil { // connected before the drain, as database/sql's pool is
		b.Fatal(err)
	}
	return p
}

// quiet readies the server for a timed drain: a checkpoint, so that none
// falls due in it, and no autovacuum worker running (one may be cleaning up
// after the drain before), waited for up to a minute.
func quiet(b *testing.B, db *sql.DB) {
	ctx := context.Background()
	if _, err := db.ExecContext(ctx, `CHECKPOINT`); err != nil {
		b.Fatal(err)
	}
	for deadline := time.Now().Add(time.Minute); ; time.Sleep(10 * time.Millisecond) {
		var workers int
		if err := db.QueryRowContext(ctx, `SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'autovacuum worker'`).Scan(&workers); err != nil {
			b.Fatal(err)
		}
		if workers == 0 {
			return
		}
		if time.Now().After(deadline) {
			b.Fatalf("%d autovacuum workers still running after a minute", workers)
		}
	}
}

// leastClaim is the claim the article's relay needs and no more: the rows
// of outbox_unsent, whose predicate (since migration 7, deliver_at IS NULL
// too) its WHERE must imply for the server to read that index.
const leastClaim = `SELECT id, message_key::text, type, payload::text, COALESCE(aggregate, ''), COALESCE(seq, 0)
	FROM outbox WHERE sent_at IS NULL AND parked_at IS NULL AND deliver_at IS NULL ORDER BY id LIMIT 100 FOR UPDATE SKIP LOCKED`

// relaysClaim is the text of the claim a relay made by Open and NewRelay,
// with perAggregate, sends to the database named, captured by a pgx tracer
// from one pass: call it while the outbox is empty. The claim has no
// parameters: its batch size and limits are written into it.
func relaysClaim(b *testing.B, name string, perAggregate bool) string {
	var t claimTracer
	p := newPool(b, name, &t)
	defer p.Close()
	relay, err := openOutbox(b, p).NewRelay(&counted{}, postgres.RelayConfig{WholeTable: !perAggregate})
	if err != nil {
		b.Fatal(err)
	}
	if n, err := relay.PublishPending(context.Background()); n != 0 || err != nil {
		b.Fatalf("the pass that shows the claim: %d, %v; want 0, <nil> (an empty outbox)", n, err)
	}
	if t.claim == "" {
		b.Fatal("the relay's pass sent no claim (FOR UPDATE ... SKIP LOCKED) that the tracer saw")
	}
	return t.claim
}

// claimTracer is a pgx.QueryTracer that keeps the text of the last claim
// (a statement with FOR UPDATE and SKIP LOCKED) its connections sent.
type claimTracer struct {
	mu    sync.Mutex
	claim string
}

func (t *claimTracer) TraceQueryStart(ctx context.Context, _ *pgx.Conn, data pgx.TraceQueryStartData) context.Context {
	if strings.Contains(data.SQL, "FOR UPDATE") && strings.Contains(data.SQL, "SKIP LOCKED") {
		t.mu.Lock()
		defer t.mu.Unlock()
		t.claim = data.SQL
	}
	return ctx
}

func (t *claimTracer) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

// barePass is a polling relay's pass with nothing but its statements:
// BEGIN, the claim (claimSQL), the mark, COMMIT, one round trip each; it
// times the claim and the mark. With relayColumns the claim returns the
// columns the relay's claims do (the message, the log's position, and with
// PerAggregate the unsent head), read and dropped; otherwise
// leastClaim's.
type barePass struct {
	conn         *pgx.Conn
	broker       postgres.MessageBroker
	claimSQL     string
	relayColumns bool
	claim, mark  time.Duration
	passes       int
}

func (p *barePass) pass(ctx context.Context) (int, error) {
	tx, err := p.conn.BeginTx(ctx, pgx.TxOptions{IsoLevel: pgx.ReadCommitted})
	if err != nil {
		return 0, err
	}
	defer tx.Rollback(ctx)
	began := time.Now()
	rows, err := tx.Query(ctx, p.claimSQL)
	if err != nil {
		return 0, err
	}
	var ids []int64
	for rows.Next() {
		var m postgres.Message
		dest := []any{&m.ID, &m.Key, &m.Type, &m.Payload, &m.Aggregate, &m.Seq}
		if p.relayColumns {
			var rejections int
			var traceparent, tracestate, walInserted, head, headers string
			var body []byte
			var walFlushed bool
			dest = []any{&m.ID, &m.Key, &m.Type, &m.Payload, &body, &m.ContentType, &headers, &m.Time, &m.Aggregate, &m.Seq,
				&rejections, &traceparent, &tracestate, &walFlushed, &walInserted}
			if len(rows.FieldDescriptions()) > len(dest) {
				dest = append(dest, &head)
			}
		}
		if err := rows.Scan(dest...); err != nil {
			return 0, err
		}
		if err := p.broker.Publish(ctx, m); err != nil {
			break // the pass stops at the first failure; the rest wait
		}
		ids = append(ids, m.ID)
	}
	rows.Close()
	if err := rows.Err(); err != nil {
		return 0, err
	}
	claimed := time.Now()
	if _, err := tx.Exec(ctx, `UPDATE outbox SET sent_at = clock_timestamp() WHERE id = ANY($1)`, ids); err != nil {
		return 0, err
	}
	p.claim += claimed.Sub(began)
	p.mark += time.Since(claimed)
	p.passes++
	return len(ids), tx.Commit(ctx)
}

// drainWatermill writes that many orders in db, each with its message
// published through watermill's forwarder in the order's transaction, then
// times the forwarder moving them to a gochannel, each acknowledged as it
// arrives, and returns its rate.
func drainWatermill(b *testing.B, db *sql.DB, orders int) float64 {
	ctx := context.Background()
	logger := watermill.NopLogger{}
	schema := wsql.DefaultPostgreSQLSchema{SubscribeBatchSize: 100}
	offsets := wsql.DefaultPostgreSQLOffsetsAdapter{}
	const topic = "outbox" // the forwarder's table
	if _, err := db.ExecContext(ctx, `CREATE TABLE orders (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, total_cents bigint NOT NULL)`); err != nil {
		b.Fatal(err)
	}
	// The forwarder's table and its consumer's offsets, made before any
	// transaction publishes: a publisher in a transaction cannot make them.
	setup, err := wsql.NewSubscriber(wsql.BeginnerFromStdSQL(db), wsql.SubscriberConfig{
		SchemaAdapter: schema, OffsetsAdapter: offsets, ConsumerGroup: "relay", InitializeSchema: true}, logger)
	if err != nil {
		b.Fatal(err)
	}
	if err := setup.SubscribeInitialize(topic); err != nil {
		b.Fatal(err)
	}
	setup.Close()
	for i := range orders {
		if err := placeWatermillOrder(ctx, db, schema, topic, int64(100+i), logger); err != nil {
			b.Fatal(err)
		}
	}
	quiet(b, db)
	if testing.Verbose() {
		b.Logf("watermill's query for a batch, %d messages past its offset:\n%s", orders, explainWatermill(b, db, schema, offsets, topic))
	}

	out := gochannel.NewGoChannel(gochannel.Config{OutputChannelBuffer: int64(orders)}, logger)
	defer out.Close()
	delivered, err := out.Subscribe(ctx, "orders")
	if err != nil {
		b.Fatal(err)
	}
	sub, err := wsql.NewSubscriber(wsql.BeginnerFromStdSQL(db), wsql.SubscriberConfig{
		SchemaAdapter: schema, OffsetsAdapter: offsets, ConsumerGroup: "relay", PollInterval: 10 * time.Millisecond}, logger)
	if err != nil {
		b.Fatal(err)
	}
	defer sub.Close()
	fwd, err := forwarder.NewForwarder(sub, out, logger, forwarder.Config{ForwarderTopic: topic})
	if err != nil {
		b.Fatal(err)
	}
	defer fwd.Close()
	runCtx, stop := context.WithCancel(ctx)
	defer stop()
	b.StartTimer()
	start := time.Now()
	go fwd.Run(runCtx)
	deadline := time.After(5 * time.Minute)
	for i := range orders {
		select {
		case m := <-delivered:
			m.Ack()
		case <-deadline:
			b.Fatalf("watermill's forwarder delivered %d of %d messages in five minutes", i, orders)
		}
	}
	elapsed := time.Since(start)
	b.StopTimer()
	return float64(orders) / elapsed.Seconds()
}

// placeWatermillOrder writes an order and, in its transaction, its
// OrderPlaced message through watermill's forwarder.
func placeWatermillOrder(ctx context.Context, db *sql.DB, schema wsql.SchemaAdapter, topic string, totalCents int64, logger watermill.LoggerAdapter) error {
	tx, err := db.BeginTx(ctx, nil)
	if err != nil {
		return err
	}
	defer tx.Rollback()
	var id int64
	if err := tx.QueryRowContext(ctx, `INSERT INTO orders (total_cents) VALUES ($1) RETURNING id`, totalCents).Scan(&id); err != nil {
		return err
	}
	pub, err := wsql.NewPublisher(wsql.TxFromStdSQL(tx), wsql.PublisherConfig{SchemaAdapter: schema}, logger)
	if err != nil {
		return err
	}
	event := fmt.Appendf(nil, `{"orderId":%d,"totalCents":%d}`, id, totalCents)
	fwd := forwarder.NewPublisher(pub, forwarder.PublisherConfig{ForwarderTopic: topic})
	if err := fwd.Publish("orders", message.NewMessage(watermill.NewUUID(), event)); err != nil {
		return err
	}
	return tx.Commit()
}

// explainWatermill is the plan of the query watermill's subscriber runs for
// the first batch of topic, run in a transaction that is rolled back.
func explainWatermill(b *testing.B, db *sql.DB, schema wsql.SchemaAdapter, offsets wsql.OffsetsAdapter, topic string) string {
	ctx := context.Background()
	q, err := schema.SelectQuery(wsql.SelectQueryParams{Topic: topic, ConsumerGroup: "relay", OffsetsAdapter: offsets})
	if err != nil {
		b.Fatal(err)
	}
	tx, err := db.BeginTx(ctx, nil)
	if err != nil {
		b.Fatal(err)
	}
	defer tx.Rollback()
	before, err := offsets.BeforeSubscribingQueries(wsql.BeforeSubscribingQueriesParams{Topic: topic, ConsumerGroup: "relay"})
	if err != nil {
		b.Fatal(err)
	}
	for _, q := range before { // the consumer group's offset, as a subscriber writes it first
		if _, err := tx.ExecContext(ctx, q.Query, q.Args...); err != nil {
			b.Fatal(err)
		}
	}
	rows, err := tx.QueryContext(ctx, "EXPLAIN (ANALYZE, BUFFERS, COSTS OFF, TIMING OFF, SUMMARY ON) "+q.Query, q.Args...)
	if err != nil {
		b.Fatal(err)
	}
	defer rows.Close()
	var plan strings.Builder
	for rows.Next() {
		var line string
		if err := rows.Scan(&line); err != nil {
			b.Fatal(err)
		}
		plan.WriteString("    " + line + "\n")
	}
	if err := rows.Err(); err != nil {
		b.Fatal(err)
	}
	return plan.String()
}

// openOutbox is the table outbox on p.
func openOutbox(b *testing.B, p *pgxpool.Pool) *postgres.Outbox[postgres.PgxTx] {
	b.Helper()
	ob, err := postgres.Open(p, postgres.Config{})
	if err != nil {
		b.Fatal(err)
	}
	return ob
}
