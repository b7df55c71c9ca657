// Package lessoncheck holds the checks of the root lesson that a reader of
// the article does not need beside it: a model of the outbox that every
// history of operations is compared with (TestModelExhaustive, FuzzModel),
// and the benchmarks make bench compares. It is a module of its own so that
// the lesson stays one package; it uses the lesson's exported API only, and
// the lesson never imports it. make test runs its tests with the lesson's.
package lessoncheck
