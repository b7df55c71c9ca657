// Package pgtest gives tests a real PostgreSQL: the one OUTBOX_POSTGRES_URL
// names (make postgres and make natsbroker start one and set it), or else a
// throwaway server that [Main] starts from the installed server programs
// (found with pg_config) in a temporary folder and removes when the tests
// end. So `go test ./...` runs every database test, or fails saying what is
// missing; it never reports ok with the database tests skipped.
//
// A throwaway server listens only on a Unix socket in its folder, with
// fsync off (it holds nothing worth keeping) and wal_level logical (the log
// relay needs it). PostgreSQL refuses to run as root: run as root, its
// programs run as the postgres user. It never touches a server it did not
// start.
package pgtest

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"os/signal"
	"os/user"
	"path/filepath"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/stdlib"
)

// EnvURL is the variable that names the server the tests use.
const EnvURL = "OUTBOX_POSTGRES_URL"

// Config is the server the tests use, once [Main] has found or started it.
var Config *pgx.ConnConfig

// Main runs a test binary's tests, as a TestMain calls it, against the
// server OUTBOX_POSTGRES_URL names. If it is not set, Main starts a
// throwaway server first (see [Start]), sets OUTBOX_POSTGRES_URL to it for
// the tests, and stops and removes it after them, and also if the process
// is interrupted or killed (a watcher process removes it then). Where no
// server can be had, Main fails the binary with a message that says how to
// get one, and runs no test.
func Main(m *testing.M) {
	os.Exit(Run(m))
}

// Run is Main, returning the exit code instead of exiting, for a TestMain
// that has its own servers to stop after the tests.
func Run(m *testing.M) int {
	url := os.Getenv(EnvURL)
	if url == "" {
		srv, err := Start()
		if err != nil {
			fmt.Fprintf(os.Stderr, "pgtest: %s is not set, and no throwaway server could be started: %v\n"+
				"Install PostgreSQL 15 or later (Debian: apt-get install postgresql), or run make postgres in the repository's root.\n", EnvURL, err)
			return 2
		}
		defer srv.Remove()
		interrupted := make(chan os.Signal, 1)
		signal.Notify(interrupted, os.Interrupt, syscall.SIGTERM)
		go func() {
			<-interrupted
			srv.Remove()
			os.Exit(130)
		}()
		url = srv.ConnString()
		os.Setenv(EnvURL, url)
		fmt.Fprintf(os.Stderr, "pgtest: %s is not set: started a throwaway PostgreSQL in %s, removed when the tests end\n", EnvURL, srv.Dir)
	}
	cfg, err := pgx.ParseConfig(url)
	if err != nil {
		fmt.Fprintf(os.Stderr, "pgtest: %s: %v\n", EnvURL, err)
		return 2
	}
	Config = cfg
	return m.Run()
}

// Server is a PostgreSQL server in a temporary folder of its own: its
// data in Dir/data, its socket in Dir, its log in Dir/server.log.
type Server struct {
	Dir    string
	bindir string
	as     []string // how its programs run: as the postgres user when we are root
	opts   string
}

// Start makes and starts a throwaway server, with the postgres options opts
// ("-c", "name=value", …) after its own. Remove stops and removes it; if
// the process that started it dies first, a watcher process does.
func Start(opts ...string) (*Server, error) {
	out, err := exec.Command("pg_config", "--bindir").Output()
	if err != nil {
		return nil, fmt.Errorf("pg_config --bindir: %w (is PostgreSQL installed?)", err)
	}
	bindir := strings.TrimSpace(string(out))
	for _, prog := range []string{"initdb", "pg_ctl", "postgres"} {
		if _, err := os.Stat(filepath.Join(bindir, prog)); err != nil {
			return nil, fmt.Errorf("PostgreSQL's server program %s is not in %s: %w", prog, bindir, err)
		}
	}
	dir, err := os.MkdirTemp("", "outbox-postgres.")
	if err != nil {
		return nil, err
	}
	s := &Server{Dir: dir, bindir: bindir, opts: strings.Join(opts, " ")}
	if err := os.Chmod(dir, 0o755); err != nil {
		os.RemoveAll(dir)
		return nil, err
	}
	if os.Geteuid() == 0 {
		pg, err := user.Lookup("postgres")
		if err != nil {
			os.RemoveAll(dir)
			return nil, fmt.Errorf("running as root, but there is no postgres user to run the server as: %w", err)
		}
		uid, _ := strconv.Atoi(pg.Uid)
		if err := os.Chown(dir, uid, -1); err != nil {
			os.RemoveAll(dir)
			return nil, err
		}
		s.as = []string{"runuser", "-u", "postgres", "--"}
	}
	if err := s.watch(); err != nil {
		os.RemoveAll(dir)
		return nil, err
	}
	if err := s.Run("initdb", "-D", filepath.Join(dir, "data"), "-U", "postgres", "-A", "trust", "-E", "UTF8", "--no-sync"); err != nil {
		s.Remove()
		return nil, err
	}
	if err := s.Ctl("start"); err != nil {
		s.Remove()
		return nil, err
	}
	return s, nil
}

// StartStandby makes a streaming standby of s (pg_basebackup -R of its
// data, with the log streamed, and primary_conninfo naming s with the
// application_name name, as s's pg_stat_replication and
// synchronous_standby_names know it) in a temporary folder of its own,
// and starts it with the postgres options opts. Remove stops and removes
// it; if the process that started it dies first, a watcher process does.
func (s *Server) StartStandby(name string, opts ...string) (*Server, error) {
	dir, err := os.MkdirTemp("", "outbox-standby.")
	if err != nil {
		return nil, err
	}
	sb := &Server{Dir: dir, bindir: s.bindir, as: s.as, opts: strings.Join(opts, " ")}
	if err := os.Chmod(dir, 0o755); err != nil {
		os.RemoveAll(dir)
		return nil, err
	}
	if len(s.as) > 0 {
		info, err := os.Stat(s.Dir)
		if err != nil {
			os.RemoveAll(dir)
			return nil, err
		}
		if err := os.Chown(dir, int(info.Sys().(*syscall.Stat_t).Uid), -1); err != nil {
			os.RemoveAll(dir)
			return nil, err
		}
	}
	if err := sb.watch(); err != nil {
		os.RemoveAll(dir)
		return nil, err
	}
	conninfo := "host=" + s.Dir + " user=postgres application_name=" + name
	// -R: standby.signal, and primary_conninfo from conninfo.
	if err := sb.Run("pg_basebackup", "-D", filepath.Join(dir, "data"), "-R", "-X", "stream", "--no-sync", "-d", conninfo); err != nil {
		sb.Remove()
		return nil, err
	}
	if err := sb.Ctl("start"); err != nil {
		sb.Remove()
		return nil, err
	}
	return sb, nil
}

// Rebuild makes s, a server killed or stopped, a streaming standby of
// primary named name, in its own folder (so on its own socket, which a
// client's host list already names): its data replaced by a base backup of
// primary's, as failover tooling rebuilds an old primary to follow the new
// one. It starts it with its options.
func (s *Server) Rebuild(primary *Server, name string) error {
	if pid, ok := s.postmaster(); ok && alive(pid) {
		return errors.New("pgtest: Rebuild: the server runs; stop or kill it first")
	}
	// A killed postmaster leaves its socket's lock file, naming a pid that
	// may live on as a zombie nobody reaps: the new server would take it
	// for a server running.
	stale, _ := filepath.Glob(filepath.Join(s.Dir, ".s.PGSQL.*"))
	for _, f := range append(stale, filepath.Join(s.Dir, "data")) {
		if err := os.RemoveAll(f); err != nil {
			return err
		}
	}
	conninfo := "host=" + primary.Dir + " user=postgres application_name=" + name
	if err := s.Run("pg_basebackup", "-D", filepath.Join(s.Dir, "data"), "-R", "-X", "stream", "-c", "fast", "--no-sync", "-d", conninfo); err != nil {
		return err
	}
	return s.Ctl("start")
}

// Received is the position in the log, as a number, up to which s, a
// standby, has received and flushed what its primary sent (what it has
// replayed, if it never streamed): failover tooling promotes the standby
// that received the most, which holds every commit any standby
// acknowledged.
func (s *Server) Received(ctx context.Context) (uint64, error) {
	db, err := s.open()
	if err != nil {
		return 0, err
	}
	defer db.Close()
	var lsn string
	if err := db.QueryRowContext(ctx, `SELECT coalesce(pg_last_wal_receive_lsn(), pg_last_wal_replay_lsn())::text`).Scan(&lsn); err != nil {
		return 0, err
	}
	hi, lo, _ := strings.Cut(lsn, "/")
	h, err1 := strconv.ParseUint(hi, 16, 32)
	l, err2 := strconv.ParseUint(lo, 16, 32)
	if err := errors.Join(err1, err2); err != nil {
		return 0, fmt.Errorf("pgtest: a position %q: %w", lsn, err)
	}
	return h<<32 | l, nil
}

// Follow points s, a standby, at primary, streaming as name, as failover
// tooling does after a promotion: its primary_conninfo changed and
// reloaded. It follows primary's new timeline.
func (s *Server) Follow(ctx context.Context, primary *Server, name string) error {
	db, err := s.open()
	if err != nil {
		return err
	}
	defer db.Close()
	conninfo := "host=" + primary.Dir + " user=postgres application_name=" + name
	for _, q := range []string{`ALTER SYSTEM SET primary_conninfo = '` + conninfo + `'`, `SELECT pg_reload_conf()`} {
		if _, err := db.ExecContext(ctx, q); err != nil {
			return fmt.Errorf("pgtest: %s: %w", q, err)
		}
	}
	return nil
}

// open is a pool of one connection to s's postgres database.
func (s *Server) open() (*sql.DB, error) {
	cfg, err := pgx.ParseConfig(s.ConnString())
	if err != nil {
		return nil, err
	}
	db := stdlib.OpenDB(*cfg)
	db.SetMaxOpenConns(1)
	return db, nil
}

// StartReceiveWAL starts pg_receivewal --synchronous on the server, as
// application name: a WAL archiver, which streams and flushes the log as a
// standby does, and reports it flushed, but replays nothing and can never
// be promoted (a backup tool's streaming). stop ends it and removes what
// it received.
func (s *Server) StartReceiveWAL(name string) (stop func(), err error) {
	dir, err := os.MkdirTemp("", "outbox-receivewal.")
	if err != nil {
		return nil, err
	}
	if len(s.as) > 0 {
		info, err := os.Stat(s.Dir)
		if err == nil {
			err = os.Chown(dir, int(info.Sys().(*syscall.Stat_t).Uid), -1)
		}
		if err != nil {
			os.RemoveAll(dir)
			return nil, err
		}
	}
	argv := append(append([]string{}, s.as...), filepath.Join(s.bindir, "pg_receivewal"), "--synchronous", "--no-loop",
		"-D", dir, "-d", "host="+s.Dir+" user=postgres application_name="+name)
	cmd := exec.Command(argv[0], argv[1:]...)
	cmd.Dir = s.Dir
	if err := cmd.Start(); err != nil {
		os.RemoveAll(dir)
		return nil, err
	}
	done := make(chan struct{})
	go func() { cmd.Wait(); close(done) }()
	return func() {
		cmd.Process.Signal(syscall.SIGTERM)
		<-done
		os.RemoveAll(dir)
	}, nil
}

// Kill kills the server's postmaster and every process it started with
// SIGKILL, as a machine that dies would: nothing is flushed, nobody is
// told. Remove still removes its folder.
func (s *Server) Kill() error {
	pid, ok := s.postmaster()
	if !ok {
		return errors.New("no postmaster.pid: the server is not running")
	}
	// Stopped first, so that it starts no process while its children go.
	if err := syscall.Kill(pid, syscall.SIGSTOP); err != nil {
		return err
	}
	children, _ := exec.Command("pgrep", "-P", strconv.Itoa(pid)).Output()
	for _, c := range strings.Fields(string(children)) {
		if n, err := strconv.Atoi(c); err == nil {
			syscall.Kill(n, syscall.SIGKILL)
		}
	}
	return syscall.Kill(pid, syscall.SIGKILL)
}

// watch starts a process that removes the server once this process is
// gone, whatever ended it: a test binary that panics, times out or is
// killed runs no deferred call.
func (s *Server) watch() error {
	stop := fmt.Sprintf(`while kill -0 %d 2>/dev/null; do sleep 1; done
if [ -f %[2]q/data/postmaster.pid ]; then (cd %[2]q && %[3]s %[4]q -D %[2]q/data -m immediate -w stop) >/dev/null 2>&1; fi
rm -rf %[2]q`, os.Getpid(), s.Dir, strings.Join(s.as, " "), filepath.Join(s.bindir, "pg_ctl"))
	cmd := exec.Command("bash", "-c", stop)
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true} // not ended with our process group
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("start the server's watcher: %w", err)
	}
	go cmd.Wait()
	return nil
}

// ConnString is the server's postgres database as the superuser postgres.
func (s *Server) ConnString() string {
	return "host=" + s.Dir + " user=postgres dbname=postgres sslmode=disable"
}

// Ctl runs pg_ctl on the server with args, waiting for it (-w, at most a
// minute); a start gets the server's options.
func (s *Server) Ctl(args ...string) error {
	full := []string{"-D", filepath.Join(s.Dir, "data"), "-w", "-t", "60"}
	if len(args) > 0 && args[len(args)-1] == "start" {
		o := "-k " + s.Dir + " -c listen_addresses='' -c fsync=off -c full_page_writes=off -c wal_level=logical " + s.opts
		full = append(full, "-l", filepath.Join(s.Dir, "server.log"), "-o", o)
	}
	return s.Run("pg_ctl", append(full, args...)...)
}

// Run runs one of the server's programs with args, from the server's
// folder (the postgres user may not enter the test's), and returns its
// output and the server's log in its error.
func (s *Server) Run(prog string, args ...string) error {
	argv := append(append(append([]string{}, s.as...), filepath.Join(s.bindir, prog)), args...)
	cmd := exec.Command(argv[0], argv[1:]...)
	cmd.Dir = s.Dir
	if out, err := cmd.CombinedOutput(); err != nil {
		log, _ := os.ReadFile(filepath.Join(s.Dir, "server.log"))
		return fmt.Errorf("%s %v: %v\n%s\n%s", prog, args, err, out, log)
	}
	return nil
}

// Remove stops the server at once, if it runs, and removes its folder. The
// folder goes even when the stop fails (a server a test killed); the stop's
// error is returned.
func (s *Server) Remove() error {
	var err error
	if pid, ok := s.postmaster(); ok && alive(pid) { // not one killed already
		err = s.Ctl("-m", "immediate", "stop")
	}
	return errors.Join(err, os.RemoveAll(s.Dir))
}

// alive reports whether process pid runs: it exists and is not a zombie
// that nobody reaped (a killed postmaster whose parent is gone).
func alive(pid int) bool {
	if syscall.Kill(pid, 0) != nil {
		return false
	}
	stat, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return true // no /proc: take it for running
	}
	// pid (comm) state ...: the state follows the last ')'.
	i := strings.LastIndexByte(string(stat), ')')
	return i < 0 || i+2 >= len(stat) || stat[i+2] != 'Z'
}

// postmaster is the pid the server's postmaster.pid names, if it has one.
func (s *Server) postmaster() (int, bool) {
	b, err := os.ReadFile(filepath.Join(s.Dir, "data", "postmaster.pid"))
	if err != nil {
		return 0, false
	}
	pid, err := strconv.Atoi(strings.TrimSpace(strings.SplitN(string(b), "\n", 2)[0]))
	return pid, err == nil
}

var databases atomic.Int64

// NewBlankDatabase creates an empty database on the tests' server for tb
// alone, to be dropped when tb ends, and returns its name.
func NewBlankDatabase(tb testing.TB) string {
	tb.Helper()
	if Config == nil {
		tb.Fatal("pgtest: no server: call pgtest.Main from the package's TestMain")
	}
	ctx := context.Background()
	admin := Open(tb, Config.Database, "")
	name := fmt.Sprintf("outbox_test_%d_%d", os.Getpid(), databases.Add(1))
	if _, err := admin.ExecContext(ctx, "CREATE DATABASE "+name); err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() {
		if _, err := admin.ExecContext(ctx, "DROP DATABASE "+name+" WITH (FORCE)"); err != nil {
			tb.Error(err)
		}
	})
	return name
}

// Open returns a connection pool, through pgx's stdlib driver, to the
// database named on the tests' server, whose connections show app (if not
// empty) as their application_name; it is closed when tb ends.
func Open(tb testing.TB, database, app string) *sql.DB {
	tb.Helper()
	if Config == nil {
		tb.Fatal("pgtest: no server: call pgtest.Main from the package's TestMain")
	}
	cfg := Config.Copy()
	cfg.Database = database
	if app != "" {
		cfg.RuntimeParams["application_name"] = app
	}
	db := stdlib.OpenDB(*cfg)
	tb.Cleanup(func() { db.Close() })
	return db
}
