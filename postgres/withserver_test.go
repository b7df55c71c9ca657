package postgres_test

import (
	"bufio"
	"bytes"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
)

// TestWithServerLeavesAServerItDidNotStart: with-server.sh on a kept folder
// (make shop SHOP_DATA=folder) where a server of an earlier run still runs
// says so and exits, and that server goes on; the first run then stops it
// cleanly. (Caught: the second run's start failed on the lock file, and its
// exit trap stopped the first run's server.)
func TestWithServerLeavesAServerItDidNotStart(t *testing.T) {
	parent, err := os.MkdirTemp("", "outbox-with-server-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(parent) })
	if err := os.Chmod(parent, 0o755); err != nil { // the server's user goes through it
		t.Fatal(err)
	}
	dir := filepath.Join(parent, "data")
	env := append(os.Environ(), "OUTBOX_POSTGRES_DATA="+dir)
	first := exec.Command("./with-server.sh", "bash", "-c", "echo ready; cat >/dev/null")
	first.Env = env
	stdin, err := first.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	stdout, err := first.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	var firstErr bytes.Buffer
	first.Stderr = &firstErr
	if err := first.Start(); err != nil {
		t.Fatal(err)
	}
	defer first.Process.Kill()
	if line, err := bufio.NewReader(stdout).ReadString('\n'); err != nil || line != "ready\n" {
		t.Fatalf("the first run: %q, %v; it exited: %v\n%s", line, err, first.Wait(), firstErr.String())
	}
	second := exec.Command("./with-server.sh", "true")
	second.Env = env
	out, secondErr := second.CombinedOutput()
	pid, err := os.ReadFile(filepath.Join(dir, "data", "postmaster.pid"))
	if err != nil {
		t.Fatalf("the first run's server is gone after the second run: %v", err)
	}
	n, err := strconv.Atoi(strings.SplitN(string(pid), "\n", 2)[0])
	if err != nil || syscall.Kill(n, 0) != nil {
		t.Fatalf("the first run's server (postmaster.pid %q) no longer runs after the second run", strings.SplitN(string(pid), "\n", 2)[0])
	}
	if secondErr == nil || !strings.Contains(string(out), "already runs") {
		t.Fatalf("the second run on the same folder: %v\n%s; want it refused, saying a server runs there", secondErr, out)
	}
	stdin.Close()
	if err := first.Wait(); err != nil {
		t.Fatalf("the first run: %v\n%s", err, firstErr.String())
	}
	if _, err := os.Stat(filepath.Join(dir, "data", "postmaster.pid")); !os.IsNotExist(err) {
		t.Fatalf("the first run left its server running: %v", err)
	}
}
