package outbox

// This file is compiled only into the package's tests. It lets them reach
// one unexported seam, as net/http's export_test.go does, without adding API
// that callers of the package could see.

// SetBeforeCommit makes every transaction of db call f just before it commits
// (nil stops that). A test whose f panics stands for a process that dies with
// the transaction still open: the transaction must then roll back.
func SetBeforeCommit(db *Database, f func()) {
	db.mu.Lock()
	defer db.mu.Unlock()
	db.beforeCommit = f
}
