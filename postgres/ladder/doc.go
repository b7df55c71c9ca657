// Package ladder holds no code: it is the way from package minimum, the
// outbox in about a hundred lines, to package postgres, in six rungs. Each
// rung is a small diff on the one before (testdata/N-name.patch) and a test
// (testdata/N-name_test.go) that shows the failure the rung prevents: it
// fails on the rung below and passes on its own. README.md beside it reads
// them in order; make ladder builds every rung and runs its tests.
package ladder
