//go:build browser

package main

// The live page in a real browser: headless Chromium, driven by chromedp.
// Built only with -tags browser (make page), since it needs Chromium.

import (
	"context"
	"fmt"
	"os"
	"regexp"
	"strconv"
	"testing"
	"time"

	"github.com/chromedp/chromedp"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"example.com/patterns/enterprise/outbox/natsbroker"
)

// The article's scenario played on the page by clicking: the broker down,
// two orders, each shown waiting in the outbox; the broker up, each shown
// sent and reserved. At each step the page's numbers are the database's and
// the stream's. Bad input from the form gets the API's answer and changes
// nothing; a reload shows the state as it is; a relay killed and started
// again sends what waited. OUTBOX_SCREENSHOT=file writes a screenshot of
// the page after the scenario. (Caught: a page whose state query took an
// order with its event unsent for one sent: it showed "sent" while the
// outbox held the row.)
func TestPagePlaysTheArticlesScenario(t *testing.T) {
	base, db, out := startShop(t)
	brokerURL := regexp.MustCompile(`broker on (nats://\S+);`).FindStringSubmatch(out.String())
	if brokerURL == nil {
		t.Fatalf("the shop named no broker: %s", out)
	}
	nc, err := nats.Connect(brokerURL[1], nats.MaxReconnects(-1))
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}

	chromium := os.Getenv("CHROMIUM")
	if chromium == "" {
		chromium = "/usr/bin/chromium"
	}
	alloc, cancelAlloc := chromedp.NewExecAllocator(context.Background(), append(chromedp.DefaultExecAllocatorOptions[:],
		chromedp.ExecPath(chromium), chromedp.NoSandbox, chromedp.DisableGPU,
		chromedp.Flag("disable-quic", true), chromedp.Flag("disable-component-update", true),
		chromedp.Flag("disable-sync", true), chromedp.WindowSize(1400, 900))...)
	defer cancelAlloc()
	browser, cancelBrowser := chromedp.NewContext(alloc)
	defer cancelBrowser()
	ctx, cancel := context.WithTimeout(browser, 3*time.Minute)
	defer cancel()
	run := func(actions ...chromedp.Action[chromedp.Void]) {
		t.Helper()
		if err := chromedp.Do(ctx, actions...); err != nil {
			t.Fatal(err)
		}
	}
	// text is an element's text now; until waits for a JavaScript
	// condition on the page.
	text := func(sel string) string {
		t.Helper()
		s, err := chromedp.Run(ctx, chromedp.Text(sel))
		if err != nil {
			t.Fatal(err)
		}
		return s
	}
	until := func(what, js string) {
		t.Helper()
		run(chromedp.Poll[chromedp.Void](js, chromedp.WithPollingTimeout(time.Minute)))
		t.Logf("page shows %s", what)
	}
	states := func(want string, n int) string {
		return fmt.Sprintf(`document.querySelectorAll('#orders tr[data-state="%s"]').length === %d`, want, n)
	}
	// matches checks the page against the database and the stream.
	matches := func() {
		t.Helper()
		var unsent, sent int
		if err := db.QueryRow(`SELECT count(*) FILTER (WHERE sent_at IS NULL), count(*) FILTER (WHERE sent_at IS NOT NULL) FROM outbox`).Scan(&unsent, &sent); err != nil {
			t.Fatal(err)
		}
		// The page is at most one event behind: wait until it says what the database says.
		until(fmt.Sprintf("unsent %d, sent %d, as the database", unsent, sent),
			fmt.Sprintf(`document.getElementById("unsent").textContent === "%d" && document.getElementById("sent").textContent === "%d"`, unsent, sent))
		rows, err := db.Query(`SELECT o.id, CASE WHEN o.cancelled_at IS NOT NULL THEN 'cancelled'
			WHEN EXISTS (SELECT 1 FROM reservations r WHERE r.order_id = o.id) THEN 'reserved'
			WHEN EXISTS (SELECT 1 FROM outbox WHERE aggregate = 'order/' || o.id AND sent_at IS NULL) THEN 'waiting'
			ELSE 'sent' END FROM orders o`)
		if err != nil {
			t.Fatal(err)
		}
		defer rows.Close()
		for rows.Next() {
			var id int64
			var state string
			if err := rows.Scan(&id, &state); err != nil {
				t.Fatal(err)
			}
			shown, err := chromedp.Run(ctx, chromedp.Evaluate[string](fmt.Sprintf(`(document.querySelector('#orders tr[data-order="%d"]') || {dataset: {}}).dataset.state || ""`, id)))
			if err != nil {
				t.Fatal(err)
			}
			if shown != state {
				t.Errorf("the page shows order %d %q, the database holds it %q", id, shown, state)
			}
		}
	}
	stored := func() string {
		t.Helper()
		s, err := js.Stream(context.Background(), natsbroker.Stream)
		if err != nil {
			t.Fatal(err)
		}
		info, err := s.Info(context.Background())
		if err != nil {
			t.Fatal(err)
		}
		return strconv.FormatUint(info.State.Msgs, 10)
	}
	place := func(total string) {
		t.Helper()
		run(chromedp.SetValue("#total", total), chromedp.Click("#place-order"))
	}
	saysNow := func(want string) {
		t.Helper()
		until(fmt.Sprintf("%q", want), fmt.Sprintf(`document.getElementById("said").textContent === %q`, want))
	}

	run(chromedp.Navigate(base + "/"))
	until("its first state", `document.body.dataset.ready === "yes"`)

	run(chromedp.Click("#broker-down"))
	until("the broker down", `document.getElementById("broker-state").textContent === "down"`)
	place("2500")
	saysNow(`201: {"orderId":1}`)
	place("4000")
	saysNow(`201: {"orderId":2}`)
	until("both orders waiting", states("waiting", 2))
	matches()

	run(chromedp.Click("#broker-up"))
	until("both orders reserved", states("reserved", 2))
	matches()
	if got, want := text("#stored"), stored(); got != want {
		t.Errorf("the page says the stream holds %s messages, the stream says %s", got, want)
	}
	if got := text("#applied"); got != "2" {
		t.Errorf("the page says the warehouse applied %s, want 2", got)
	}
	if path := os.Getenv("OUTBOX_SCREENSHOT"); path != "" {
		png, err := chromedp.Run(ctx, chromedp.FullScreenshot(100))
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(path, png, 0o644); err != nil {
			t.Fatal(err)
		}
		t.Logf("screenshot of the page after the scenario in %s", path)
	}

	// Bad input from the form: the API's answers, and nothing changes.
	for total, answer := range map[string]string{
		"0":                    `422: shop: order total must be a positive number of cents, got 0`,
		"abc":                  `400: body must be one JSON object {"totalCents": a whole number of cents}`,
		"99999999999999999999": `400: body must be one JSON object {"totalCents": a whole number of cents}`,
	} {
		place(total)
		saysNow(answer)
	}
	var orders int
	if err := db.QueryRow(`SELECT count(*) FROM orders`).Scan(&orders); err != nil || orders != 2 {
		t.Errorf("orders after bad input: %d, %v; want 2", orders, err)
	}

	// A reload shows the state as it is, not only what happened since.
	run(chromedp.Reload())
	until("both orders reserved after a reload", `document.body.dataset.ready === "yes" && `+states("reserved", 2))

	// The relay killed, an order placed, the relay started: the event waited.
	run(chromedp.Click("#relay-stop"))
	until("the relay killed", `document.getElementById("relay-state").textContent === "killed"`)
	place("700")
	saysNow(`201: {"orderId":3}`)
	until("order 3 waiting", states("waiting", 1))
	matches()
	run(chromedp.Click("#relay-start"))
	until("all three reserved", states("reserved", 3))
	matches()
}
