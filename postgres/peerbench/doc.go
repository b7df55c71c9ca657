// Package peerbench measures the polling relay of package postgres against
// watermill-sql's forwarder, the peer a team might run instead, and against
// bare loops of the statements a relay's pass sends: see BenchmarkDrain,
// which make measure-watermill runs. It is a module of its own, so that
// watermill is no dependency of the postgres module, and holds nothing but
// the benchmark.
package peerbench
