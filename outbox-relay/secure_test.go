package main

// The relay to brokers that take only secured connections: a JetStream
// that takes TLS with a client certificate and a user with a password, and
// a RabbitMQ node (Debian's, started by rabbittest) with an AMQPS listener
// that asks for a client certificate and a user of its own. Each
// certificate is made here, with crypto/x509.

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/nats-io/nkeys"
	amqp "github.com/rabbitmq/amqp091-go"

	"example.com/patterns/enterprise/outbox/rabbitbroker/rabbittest"
)

// readmeEnv is the README's block of variables marked <!-- env: name -->,
// as sh reads it: the block, as printed, sourced by sh with set -a, each
// line NAME=VALUE a variable whose value must be the one the line means
// (a value with a space unquoted is cut there). Then swap's values replace
// the README's (its hosts and files); every name in swap must be in the
// block, and the block at most ten lines.
func readmeEnv(t *testing.T, name string, swap map[string]string) []string {
	t.Helper()
	readme, err := os.ReadFile("README.md")
	if err != nil {
		t.Fatal(err)
	}
	_, block, ok := strings.Cut(string(readme), "<!-- env: "+name+" -->\n```sh\n")
	block, _, ok2 := strings.Cut(block, "```")
	if !ok || !ok2 {
		t.Fatalf("README.md has no block <!-- env: %s -->", name)
	}
	file := filepath.Join(t.TempDir(), name+".env")
	if err := os.WriteFile(file, []byte(block), 0o600); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command("sh", "-c", `set -a; . "$1"; set +a; env -0`, "sh", file)
	cmd.Env = []string{"PATH=" + os.Getenv("PATH")}
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("sh sourcing README.md's %s block: %v", name, err)
	}
	sourced := map[string]string{}
	for kv := range strings.SplitSeq(string(out), "\x00") {
		if key, value, ok := strings.Cut(kv, "="); ok && strings.HasPrefix(key, "OUTBOX_") {
			sourced[key] = value
		}
	}
	var env []string
	used := map[string]bool{}
	for line := range strings.SplitSeq(strings.TrimSpace(block), "\n") {
		key, meant, ok := strings.Cut(line, "=")
		if !ok || !strings.HasPrefix(key, "OUTBOX_") {
			t.Fatalf("README.md's %s block: %q is not OUTBOX_NAME=value", name, line)
		}
		if len(meant) >= 2 && meant[0] == '\'' && meant[len(meant)-1] == '\'' {
			meant = meant[1 : len(meant)-1]
		}
		value, ok := sourced[key]
		if !ok || value != meant {
			t.Errorf("README.md's %s block, sourced by sh: %s is %q, where the line means %q", name, key, value, meant)
		}
		if v, ok := swap[key]; ok {
			value, used[key] = v, true
		}
		env = append(env, key+"="+value)
	}
	for key := range swap {
		if !used[key] {
			t.Errorf("README.md's %s block has no %s", name, key)
		}
	}
	if len(env) > 10 {
		t.Errorf("README.md's %s block is %d lines, want at most ten", name, len(env))
	}
	return env
}

// runFromReadme runs the relay from the README's block name alone (no
// flag but the command), with swap's values: it delivers three more rows,
// as sent counts them, and stops on SIGTERM with exit code 0.
func (e *env) runFromReadme(name string, swap map[string]string, sent func() int) {
	t := e.t
	t.Helper()
	addr := freeAddr(t)
	swap["OUTBOX_HTTP_ADDR"] = addr
	e.bare, e.args, e.environ = true, nil, readmeEnv(t, name, swap)
	defer func() { e.bare, e.environ = false, nil }()
	before := sent()
	p := e.start("run")
	waitFor(t, "/readyz 200, run from the README's "+name+" block", func() bool { code, _ := get("http://" + addr + "/readyz"); return code == 200 })
	e.writeOrders(3)
	waitFor(t, "the three rows delivered", func() bool { return sent() >= before+3 })
	if err := p.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	if code := p.wait(t); code != 0 {
		t.Errorf("the relay run from the README's %s block exited %d:\n%s", name, code, p.stderr)
	}
}

// badRun is a run the relay must refuse: with args, saying want.
type badRun struct {
	what string
	args []string
	want string
}

// refusedRuns runs the relay with each bad run's flags, and fails the test
// unless each exits non-zero saying what it should, secret nowhere in it.
func (e *env) refusedRuns(secret string, runs []badRun) {
	e.t.Helper()
	defer func(args []string) { e.args = args }(e.args)
	for _, bad := range runs {
		e.args = bad.args
		code, out := e.runOnce("run")
		if code == 0 || !strings.Contains(out, bad.want) {
			e.t.Errorf("run with %s exited %d, want a refusal with %q:\n%s", bad.what, code, bad.want, out)
		}
		noSecret(e.t, "run's output with "+bad.what, out, secret)
		e.t.Logf("%s: exit %d: %s", bad.what, code, strings.TrimSpace(out))
	}
}

// noSecret fails t if the secret is in what the process wrote.
func noSecret(t *testing.T, what, text, secret string) {
	t.Helper()
	if strings.Contains(text, secret) {
		t.Errorf("%s holds the secret:\n%s", what, text)
	}
}

// The relay to a JetStream that takes only TLS with a client certificate
// signed by its CA, and the user relay with its password: with the
// password from a file, or from OUTBOX_NATS_PASSWORD, it migrates and
// relays; a wrong password, a certificate of another CA, or none, is
// refused with a message that names the flags at fault, exit code 1, and
// nothing is published. The password is in none of the process's output,
// nor in /metrics. (Caught: no TLS and no credentials at all.)
func TestRelayProcessToATLSOnlyJetStream(t *testing.T) {
	e := newEnv(t)
	authority := newCA(t, "nats")
	const password = "pw-7Qk2-never-printed"
	srv := startJetStream(t, server.Options{TLS: true, TLSVerify: true, TLSConfig: authority.serverTLS(), TLSTimeout: 5,
		Users: []*server.User{{Username: "relay", Password: password}}})
	e.nats().url = strings.Replace(srv.ClientURL(), "nats://", "tls://", 1)
	nc, err := nats.Connect(e.nats().url, nats.Secure(authority.clientTLS()), nats.UserInfo("relay", password))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	if e.nats().js, err = jetstream.New(nc); err != nil {
		t.Fatal(err)
	}
	cert, key := authority.issue("relay", false)
	tlsArgs := []string{"-nats-ca", authority.File, "-nats-cert", cert, "-nats-key", key, "-nats-user", "relay"}
	good := secretFile(t, password)

	e.args = append(tlsArgs, "-nats-password-file", good)
	if code, out := e.runOnce("migrate"); code != 0 {
		t.Fatalf("migrate exited %d:\n%s", code, out)
	}
	e.writeOrders(5)

	stranger := newCA(t, "stranger")
	strangerCert, strangerKey := stranger.issue("relay", false)
	e.refusedRuns(password, []badRun{
		{"a wrong password", append(tlsArgs, "-nats-password-file", secretFile(t, "not-the-password")), "NATS refused -nats-user and its password"},
		{"a certificate of another CA", []string{"-nats-ca", authority.File, "-nats-cert", strangerCert, "-nats-key", strangerKey,
			"-nats-user", "relay", "-nats-password-file", good}, "NATS TLS (-nats-ca, -nats-cert"},
		{"no client certificate", []string{"-nats-ca", authority.File, "-nats-user", "relay", "-nats-password-file", good}, "NATS TLS (-nats-ca, -nats-cert"},
		{"the server's CA unknown", []string{"-nats-ca", stranger.File, "-nats-cert", cert, "-nats-key", key,
			"-nats-user", "relay", "-nats-password-file", good}, "NATS TLS (-nats-ca, -nats-cert"},
	})
	if n := e.streamMsgs(); n != 0 {
		t.Errorf("the stream holds %d messages after the refused runs, want none", n)
	}

	// The password from the environment this time.
	e.args, e.environ = tlsArgs, []string{"OUTBOX_NATS_PASSWORD=" + password}
	addr := freeAddr(t)
	p := e.start("run", "-http", addr)
	waitFor(t, "the 5 rows in the stream", func() bool { return e.streamMsgs() == 5 })
	_, metrics := get("http://" + addr + "/metrics")
	if !strings.Contains(metrics, "outbox_unsent") {
		t.Errorf("/metrics lacks the lag gauge:\n%.2000s", metrics)
	}
	noSecret(t, "/metrics", metrics, password)
	if err := p.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	if code := p.wait(t); code != 0 {
		t.Errorf("after SIGTERM the relay exited %d:\n%s", code, p.stderr)
	}
	noSecret(t, "run's output", p.stderr.String(), password)

	e.runFromReadme("nats", map[string]string{"OUTBOX_DATABASE_URL": e.database, "OUTBOX_NATS_URL": e.nats().url,
		"OUTBOX_NATS_CA": authority.File, "OUTBOX_NATS_CERT": cert, "OUTBOX_NATS_KEY": key, "OUTBOX_NATS_PASSWORD_FILE": good},
		func() int { return int(e.streamMsgs()) })
}

// The relay to RabbitMQ over amqps, as a user of its own whose password
// is in a file, with a client certificate: migrate declares the exchange
// and the queues, run checks them and relays, SIGTERM mid-traffic and a
// second run lose nothing (every row's key in the queue, each message a
// CloudEvent of -cloudevents-source /shop with that key as
// cloudEvents:id; RabbitMQ keeps no record of what it took, so a copy in
// flight at the stop may be there twice, for the consumer to drop by key). A wrong password or a
// certificate the node does not trust is refused, naming the flags, and
// publishes nothing; the password is never printed. (Caught: a relay
// process for JetStream only.)
func TestRelayProcessToRabbitMQOverAMQPS(t *testing.T) {
	e := newEnv(t)
	authority := newCA(t, "rabbitmq")
	serverCert, serverKey := authority.issue("rabbitmq-server", true)
	node, err := rabbittest.Start(rabbittest.Options{TLS: &rabbittest.TLS{CACert: authority.File, Cert: serverCert, Key: serverKey}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { node.Remove() })
	const password = "rabbit-pw-9Zx-never-printed"
	if err := node.Ctl("add_user", "relay", password); err != nil {
		t.Fatal(err)
	}
	if err := node.Ctl("set_permissions", "-p", "/", "relay", ".*", ".*", ".*"); err != nil {
		t.Fatal(err)
	}
	cert, key := authority.issue("relay", false)
	tlsArgs := []string{"-broker", "rabbitmq", "-rabbitmq", node.TLSURL(), "-rabbitmq-ca", authority.File,
		"-rabbitmq-cert", cert, "-rabbitmq-key", key, "-rabbitmq-server-name", "localhost", "-rabbitmq-user", "relay"}
	good := secretFile(t, password)
	notEvents := 0                    // messages in the queue whose cloudEvents:id is not their key
	queued := func() map[string]int { // each key in the queue, and how many times, read without taking them
		conn, err := amqp.Dial(node.URL())
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close() // and with it the channel: every message goes back to the queue
		ch, err := conn.Channel()
		if err != nil {
			t.Fatal(err)
		}
		q, err := ch.QueueDeclarePassive("warehouse", true, false, false, false, nil)
		if err != nil {
			t.Fatal(err)
		}
		deliveries, err := ch.Consume("warehouse", "", false, false, false, false, nil)
		if err != nil {
			t.Fatal(err)
		}
		keys := map[string]int{}
		for range q.Messages {
			select {
			case d := <-deliveries:
				keys[d.MessageId]++
				if id, _ := d.Headers["cloudEvents:id"].(string); id != d.MessageId || d.Headers["cloudEvents:source"] != "/shop" {
					notEvents++
				}
			case <-time.After(generous):
				t.Fatalf("the queue said it held %d messages, and gave %d", q.Messages, len(keys))
			}
		}
		return keys
	}

	e.args = append(tlsArgs, "-rabbitmq-password-file", good)
	if code, out := e.runOnce("migrate"); code != 0 {
		t.Fatalf("migrate -broker rabbitmq exited %d:\n%s", code, out)
	}
	e.writeOrders(5)
	stranger := newCA(t, "stranger")
	strangerCert, strangerKey := stranger.issue("relay", false)
	e.refusedRuns(password, []badRun{
		{"a wrong password", append(tlsArgs, "-rabbitmq-password-file", secretFile(t, "not-the-password")), "RabbitMQ refused -rabbitmq-user and its password"},
		{"a certificate of another CA", []string{"-broker", "rabbitmq", "-rabbitmq", node.TLSURL(), "-rabbitmq-ca", authority.File,
			"-rabbitmq-cert", strangerCert, "-rabbitmq-key", strangerKey, "-rabbitmq-user", "relay", "-rabbitmq-password-file", good}, "RabbitMQ TLS"},
		{"a password in the URL", []string{"-broker", "rabbitmq", "-rabbitmq", strings.Replace(node.TLSURL(), "amqps://", "amqps://relay:"+password+"@", 1)}, "the URL holds a password"},
	})
	if n := len(queued()); n != 0 {
		t.Errorf("the queue holds %d keys after the refused runs, want none", n)
	}

	e.args = append(tlsArgs, "-rabbitmq-password-file", good)
	addr := freeAddr(t)
	first := e.start("run", "-http", addr, "-cloudevents-source", "/shop")
	waitFor(t, "/readyz to answer 200", func() bool { code, _ := get("http://" + addr + "/readyz"); return code == 200 })
	stop := make(chan struct{})
	produced := make(chan int, 1)
	go func() { // one order at a time until stopped; -1 if a write failed
		n := 0
		for {
			select {
			case <-stop:
				produced <- n
				return
			default:
			}
			if err := e.writeOrder(100 + n); err != nil {
				t.Error(err)
				produced <- -1
				return
			}
			n++
		}
	}()
	waitFor(t, "55 rows sent", func() bool {
		var sent int64
		e.db.QueryRow(`SELECT count(*) FROM outbox WHERE sent_at IS NOT NULL`).Scan(&sent)
		return sent >= 55
	})
	if err := first.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	if code := first.wait(t); code != 0 {
		t.Fatalf("after SIGTERM the relay exited %d:\n%s", code, first.stderr)
	}
	_, metrics := get("http://" + addr + "/metrics")
	noSecret(t, "/metrics", metrics, password)
	second := e.start("run", "-cloudevents-source", "/shop")
	close(stop)
	n := <-produced
	if n < 0 {
		t.FailNow()
	}
	total := 5 + n
	waitFor(t, "every row sent", func() bool { return e.count(`SELECT count(*) FROM outbox WHERE sent_at IS NULL`) == 0 })
	notEvents = 0
	keys := queued()
	if notEvents != 0 {
		t.Errorf("%d messages in the queue are no CloudEvent of source /shop with their key as id (-cloudevents-source /shop)", notEvents)
	}
	var rows []string
	r, err := e.db.Query(`SELECT message_key FROM outbox`)
	if err != nil {
		t.Fatal(err)
	}
	for r.Next() {
		var k string
		r.Scan(&k)
		rows = append(rows, k)
	}
	r.Close()
	missing, copies := 0, 0
	for _, k := range rows {
		if keys[k] == 0 {
			missing++
		}
		copies += max(keys[k]-1, 0)
	}
	if len(rows) != total || missing != 0 {
		t.Errorf("%d rows for %d written, %d of them not in the queue; want every one there", len(rows), total, missing)
	}
	t.Logf("%d rows written, SIGTERM mid-traffic, all in the queue, %d copies to drop by key", total, copies)
	noSecret(t, "the relays' output", first.stderr.String()+second.stderr.String(), password)
	if !strings.Contains(first.stderr.String(), `"broker":"rabbitmq"`) {
		t.Errorf("the relay did not log its broker:\n%s", first.stderr)
	}
	if err := second.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	second.wait(t)

	e.runFromReadme("rabbitmq", map[string]string{"OUTBOX_DATABASE_URL": e.database, "OUTBOX_RABBITMQ_URL": node.TLSURL(),
		"OUTBOX_RABBITMQ_CA": authority.File, "OUTBOX_RABBITMQ_CERT": cert, "OUTBOX_RABBITMQ_KEY": key, "OUTBOX_RABBITMQ_PASSWORD_FILE": good},
		func() int { return len(queued()) })
}

// The relay's other ways to prove who it is to NATS: a token from a file
// or from OUTBOX_NATS_TOKEN, and an NKEY seed file; a wrong token, or
// another user's seed, is refused naming what was given, exit 1, and the
// secrets are in no output. (Caught: the flags taken and never tried.)
func TestRelayProcessToJetStreamWithATokenOrAnNKEY(t *testing.T) {
	e := newEnv(t)
	start := func(opts *server.Options) string {
		t.Helper()
		opts.Host, opts.Port, opts.JetStream, opts.StoreDir, opts.NoSigs = "127.0.0.1", -1, true, t.TempDir(), true
		srv, err := server.NewServer(opts)
		if err != nil {
			t.Fatal(err)
		}
		go srv.Start()
		t.Cleanup(srv.Shutdown)
		if !srv.ReadyForConnections(10 * time.Second) {
			t.Fatal("the JetStream server did not start")
		}
		return srv.ClientURL()
	}

	const token = "tok-3Fh8-never-printed"
	e.nats().url = start(&server.Options{Authorization: token})
	for _, tc := range []struct {
		what    string
		args    []string
		environ []string
		code    int
	}{
		{"the token from a file", []string{"-nats-token-file", secretFile(t, token)}, nil, 0},
		{"the token from the environment", nil, []string{"OUTBOX_NATS_TOKEN=" + token}, 0},
		{"a wrong token", []string{"-nats-token-file", secretFile(t, "not-the-token")}, nil, 1},
	} {
		e.args, e.environ = tc.args, tc.environ
		code, out := e.runOnce("migrate")
		if code != tc.code || (code == 1 && !strings.Contains(out, "NATS refused the token")) {
			t.Errorf("migrate with %s exited %d, want %d:\n%s", tc.what, code, tc.code, out)
		}
		noSecret(t, "migrate's output with "+tc.what, out, token)
	}

	user, err := nkeys.CreateUser()
	if err != nil {
		t.Fatal(err)
	}
	public, err := user.PublicKey()
	if err != nil {
		t.Fatal(err)
	}
	seed, err := user.Seed()
	if err != nil {
		t.Fatal(err)
	}
	other, err := nkeys.CreateUser()
	if err != nil {
		t.Fatal(err)
	}
	otherSeed, err := other.Seed()
	if err != nil {
		t.Fatal(err)
	}
	e.nats().url, e.environ = start(&server.Options{Nkeys: []*server.NkeyUser{{Nkey: public}}}), nil
	e.args = []string{"-nats-nkey", secretFile(t, string(seed))}
	if code, out := e.runOnce("migrate"); code != 0 {
		t.Errorf("migrate with the NKEY seed exited %d:\n%s", code, out)
	} else {
		noSecret(t, "migrate's output", out, string(seed))
	}
	e.args = []string{"-nats-nkey", secretFile(t, string(otherSeed))}
	if code, out := e.runOnce("migrate"); code != 1 || !strings.Contains(out, "NATS refused -nats-nkey") {
		t.Errorf("migrate with another user's seed exited %d, want 1 naming -nats-nkey:\n%s", code, out)
	}
	e.args = []string{"-nats-nkey", secretFile(t, "not a seed")}
	if code, out := e.runOnce("migrate"); code != 1 || !strings.Contains(out, "-nats-nkey: not an NKEY seed file") {
		t.Errorf("migrate with a file that holds no seed exited %d, want 1 naming it:\n%s", code, out)
	}
}
