# The Go edition of the Transactional Outbox example. The root package needs only
# Go and make; make postgres and make bench-postgres also need PostgreSQL's
# server programs (initdb, pg_ctl, postgres), which they find with pg_config.
#
# Learning: the lesson, then the same on a real database and broker.
#
#   make test T=patterns/enterprise/outbox   gofmt check, go vet, all tests (with -race where cgo is available)
#   make example                             the article's scenario and the crash table, printed
#   make ladder                              the ladder from the minimum to production (postgres/ladder): each rung's diff printed, its test passing on it and failing on the rung below
#   make minimum                             the minimum real outbox (postgres/minimum): its example (the article's scenario, then a lost ack and the copy dropped), on a throwaway PostgreSQL
#   make shop [SHOP_NODES=3] [SHOP_DATA=dir] [SHOP_RELAY=log] [SHOP_BROKER=rabbitmq|kafka]  the shop of shop/ on 127.0.0.1:8080 (SHOP_ADDR), until Ctrl-C
#   make page [SCREENSHOT=file]              the shop's live page, tested in headless Chromium (installed if missing)
#
# Adopting, measuring and operating: the modules' suites, their figures, the relay process.
#
#   make postgres                            the postgres/ module's tests on a throwaway PostgreSQL, PgBouncer in front for one (Debian's, installed if missing) (-race)
#   make natsbroker                          the natsbroker/ module's tests, then the shop's (shop/, a module of its own): JetStream embedded, RabbitMQ for the shop's (installed if missing), a throwaway PostgreSQL (-race)
#   make rabbitbroker                        the rabbitbroker/ module's tests: RabbitMQ (Debian's, installed if missing) on throwaway nodes, a throwaway PostgreSQL (-race)
#   make kafkabroker                         the kafkabroker/ module's tests: franz-go's Kafka-protocol cluster in Go (kfake, three brokers), a throwaway PostgreSQL (-race)
#   make outbox-relay                        the relay process's tests (outbox-relay/, a module of its own): built and run against a throwaway PostgreSQL, JetStream embedded (one with TLS and a user), RabbitMQ over amqps and PgBouncer (Debian's, installed if missing)
#   make kit                                 the kit's tests (kit/): the product modules copied under a team's module path, built, vetted and tested there
#   make lint                                staticcheck (fetched through the Go module proxy), every module
#   make fuzz [FUZZTIME=3m]                  the lesson's model-based fuzz test (lessoncheck/), for a while
#   make bench                               the lesson's benchmarks (lessoncheck/), and each pair's ratio (benchstat)
#   make bench-postgres                      the postgres/ module's benchmarks on a throwaway PostgreSQL
#   make measure-postgres                    postgres/REFERENCE.md's latency, drain and cleanup figures (about 50 s)
#   make measure-relays                      the polling relay and the log relay side by side, six runs, medians and spreads (about 4 min)
#   make measure-write                       what a team pays on every order: orders a second, p50, p99 at 1, 8, 32 producers on a durable server, with and without the outbox row (about 4 min)
#   make measure-hot                         a hot aggregate: passes over a backlog of 1,000 and 100,000 rows of one aggregate, and the claim's plan (about 30 s)
#   make measure-watermill                   the polling relay's drain against watermill-sql's forwarder and bare pgx loops (postgres/peerbench, about 7 min)
#   make soak-log-relay [SOAK=10m]           the log relay for 10 minutes against rows it cannot read, a broker that fails and sessions cut mid-transaction; its counts into postgres/figures/soak-log-relay.txt (make postgres runs it for 15 s)
#   make failover                            a primary killed and its standby promoted mid-traffic, synchronous and asynchronous, and twice in a row on a quorum of standbys, the relays (and the relay process) running through it (about 3 min)
#   make measure-natsbroker                  natsbroker/REFERENCE.md's drain (one server, synced, a cluster of 3) and latency figures
#   make knee                                orders offered at rising rates through the whole pipeline on JetStream, then on Kafka, and the plot of it (about 10 min)
#   make measure-rabbitbroker                rabbitbroker/README.md's drain figures beside JetStream's, and the latency at 100, 300 and 1,000 orders a second
#   make measure-kafkabroker                 kafkabroker/README.md's drain figures: the relay to Kafka (kfake), with kgo's default linger and none (about 2 min)
#
# make test without T does the same as with it; a T naming another pattern
# stops with a message saying which one this module holds. .ci/run runs make
# test, make postgres, make natsbroker, make rabbitbroker, make kafkabroker,
# make outbox-relay, make kit, make page and make lint; make postgres runs the test that every figure in the documents is one
# a target printed into postgres/figures/, natsbroker/figures/ or
# rabbitbroker/figures/.

PATTERN  := patterns/enterprise/outbox
T        ?= $(PATTERN)
GO       ?= go
FUZZTIME ?= 3m
SOAK     ?= 10m
# benchstat, like staticcheck, is a tool run through the module proxy, never a
# dependency of the package.
BENCHSTAT := $(GO) run golang.org/x/perf/cmd/benchstat@v0.0.0-20260908200009-22c9c6c9d4da
# The race detector needs cgo, which Go turns off where it finds no C compiler.
RACE     := $(if $(filter 1,$(shell $(GO) env CGO_ENABLED)),-race)

# bash with pipefail, so that a command piped into tee or awk fails the target
# when it fails.
SHELL       := /bin/bash
.SHELLFLAGS := -o pipefail -c

.PHONY: measure-write ladder soak-log-relay kafkabroker knee-kafka measure-kafkabroker kit minimum test pattern example fuzz bench lint postgres bench-postgres measure-postgres measure-relays measure-hot measure-watermill failover natsbroker rabbitmq-server rabbitbroker shop page measure-natsbroker measure-rabbitbroker knee outbox-relay pgbouncer

test: pattern
	@bad=$$(gofmt -l .); if [ -n "$$bad" ]; then echo "gofmt would change: $$bad" >&2; exit 1; fi
	$(GO) vet ./...
	$(GO) test $(RACE) -cover -count=1 ./...
	cd lessoncheck && $(GO) vet ./... && $(GO) test $(RACE) -count=1 ./...

pattern:
	@if [ "$(T)" != "$(PATTERN)" ]; then \
		echo "make: T=$(T) is not in this module: it holds $(PATTERN) only" >&2; exit 2; fi

# Without a package argument go test streams the examples' standard error,
# where they copy the transcript and the crash table, to the terminal.
example:
	$(GO) test -count=1 -run '^Example(_crashPoints)?$$'

fuzz:
	cd lessoncheck && $(GO) test -run '^$$' -fuzz '^FuzzModel$$' -fuzztime $(FUZZTIME) -fuzzminimizetime 10s .

# Ten rounds of every benchmark into bench.txt (about 45 s on 2 cores), then
# each pair's ratio; the benchmarks' doc comments in lessoncheck/bench_test.go state
# the claims the ratios check. A round runs each pair one right after the
# other, so that the two sides of a ratio meet the same machine (-count would
# run all rounds of one side first). The test binary is built once. benchstat
# is fetched through the module proxy, never a dependency.
bench:
	cd lessoncheck && $(GO) test -c -o ../bench.test .
	for round in 1 2 3 4 5 6 7 8 9 10; do \
		./bench.test -test.run '^$$' -test.bench . -test.benchmem -test.benchtime 200ms || exit 1; \
	done | tee bench.txt
	@rm -f bench.test
	@! grep -E '^(--- )?FAIL' bench.txt
	$(BENCHSTAT) -filter .name:PlaceOrder -col '/write@(direct outbox)' bench.txt
	$(BENCHSTAT) -filter .name:Deliver -col '/via@(publish relay)' bench.txt
	$(BENCHSTAT) -filter .name:Transaction -col /rows bench.txt

lint:
	$(GO) run honnef.co/go/tools/cmd/staticcheck@v0.8.2 ./...
	cd lessoncheck && $(GO) run honnef.co/go/tools/cmd/staticcheck@v0.8.2 ./...
	cd postgres && $(GO) run honnef.co/go/tools/cmd/staticcheck@v0.8.2 ./...
	cd natsbroker && $(GO) run honnef.co/go/tools/cmd/staticcheck@v0.8.2 ./...
	cd shop && $(GO) run honnef.co/go/tools/cmd/staticcheck@v0.8.2 ./...
	cd outbox-relay && $(GO) run honnef.co/go/tools/cmd/staticcheck@v0.8.2 ./...
	cd shop/kneeplot && $(GO) vet ./... && $(GO) run honnef.co/go/tools/cmd/staticcheck@v0.8.2 ./...
	cd rabbitbroker && $(GO) run honnef.co/go/tools/cmd/staticcheck@v0.8.2 ./...
	cd postgres/peerbench && $(GO) vet ./... && $(GO) run honnef.co/go/tools/cmd/staticcheck@v0.8.2 ./...
	cd kit && $(GO) run honnef.co/go/tools/cmd/staticcheck@v0.8.2 ./...
	cd kafkabroker && $(GO) run honnef.co/go/tools/cmd/staticcheck@v0.8.2 ./...

# module-tests checks the module in the folder $(1) with gofmt and go vet,
# then runs its tests on a PostgreSQL that postgres/with-server.sh starts in a
# fresh temporary folder and removes afterwards, whatever happens. The awk
# drops go test's "=== RUN" lines, keeps the rest (the trap test logs both
# relays' outcomes), and fails the target if any test skipped.
define module-tests
	cd $(1) && gofmt_out=$$(gofmt -l .) && [ -z "$$gofmt_out" ] || { echo "gofmt would change: $$gofmt_out" >&2; exit 1; }
	cd $(1) && $(GO) vet ./...
	@echo "postgres/with-server.sh: go test $(RACE) -count=1 -v ./... in $(1)/, on a throwaway server"
	@postgres/with-server.sh bash -c 'cd $(1) && $(GO) test $(RACE) -count=1 -v ./...' | awk '\
		/^=== / { next } { print } \
		/^ *--- PASS/ { p++ } /^ *--- FAIL/ { f++ } /^ *--- SKIP/ { s++ } \
		END { printf "$(1): %d passed, %d failed, %d skipped\n", p, f, s; exit s > 0 }'
endef

# The minimum real outbox, postgres/minimum: its example prints the
# article's scenario, then a lost ack and the copy the consumer drops, on a
# throwaway PostgreSQL (go test checks the output).
minimum:
	OUTBOX_TRANSCRIPT=1 postgres/with-server.sh bash -c 'cd postgres && $(GO) test -count=1 -v -run "^(Example|Test)" ./minimum' 2>&1 | grep -v '^=== '

# The ladder (postgres/ladder): each rung's diff on the one before applied
# to the minimum, its tests run on it and on the rung below, where its own
# must fail; -v prints each diff. make postgres runs it too.
ladder:
	postgres/with-server.sh bash -c 'cd postgres && $(GO) test -count=1 -v -run "^TestLadder$$" ./ladder' 2>&1 | grep -v '^=== '

# The postgres/ module; a test of a COMMIT cut behind PgBouncer starts one
# of its own (Debian's, installed where it is missing).
postgres: pgbouncer
	$(call module-tests,postgres)

# The log relay's soak (TestLogRelaySoak) for SOAK: producers commit
# transactions some of whose rows it cannot read, the broker fails one
# publish in 150 and its walsender is cut every 3 s; every readable row must
# reach the broker in order per aggregate, copies only after a failed
# session, every unreadable row parked, the slot past the last commit. Its
# counts go into postgres/figures/soak-log-relay.txt. make postgres runs
# the same test for 15 s.
soak-log-relay:
	OUTBOX_SOAK=$(SOAK) OUTBOX_SOAK_OUT=$(CURDIR)/postgres/figures/soak-log-relay.txt postgres/with-server.sh \
		bash -c 'cd postgres && $(GO) test -count=1 -timeout 40m -run "^TestLogRelaySoak$$" -v .' | grep -v '^=== '

# Eight interleaved rounds of the postgres/ module's benchmarks on a throwaway
# server, into postgres/figures/bench-postgres.txt, then benchstat's ratios, into
# bench-postgres.stat.txt beside it: what postgres/REFERENCE.md quotes.
bench-postgres:
	cd postgres && $(GO) test -c -o ../bench-postgres.test .
	postgres/with-server.sh bash -c 'for round in 1 2 3 4 5 6 7 8; do \
		./bench-postgres.test -test.run "^$$" -test.bench "^Benchmark(PlaceOrder|Deliver|DeliverOrdered)$$" -test.benchmem -test.benchtime 2000x || exit 1; \
	done' | tee postgres/figures/bench-postgres.txt
	@rm -f bench-postgres.test
	{ $(BENCHSTAT) -filter .name:PlaceOrder -col '/write@(direct outbox)' postgres/figures/bench-postgres.txt && \
	  $(BENCHSTAT) -filter .name:PlaceOrder -col '/write@(outbox-without-notify outbox)' postgres/figures/bench-postgres.txt && \
	  $(BENCHSTAT) -filter .name:Deliver -col '/batch@(1 100)' postgres/figures/bench-postgres.txt && \
	  $(BENCHSTAT) -filter .name:DeliverOrdered -col '/order@(table aggregate)' postgres/figures/bench-postgres.txt; } | tee postgres/figures/bench-postgres.stat.txt

# postgres/REFERENCE.md's figures that are measurements rather than benchmarks:
# the delay from commit to broker (woken by NOTIFY, and polling every second),
# a drain of 200,000 rows (marked, and deleted), and an empty pass over
# 200,000 sent rows before and after cleanup and vacuum. Each runs once, on a
# throwaway server whose autovacuum looks every second (autovacuum_naptime,
# 1 min by default), into postgres/figures/measure-postgres.txt.
measure-postgres:
	cd postgres && $(GO) test -c -o ../measure-postgres.test .
	OUTBOX_POSTGRES_OPTS='-c autovacuum_naptime=1s' postgres/with-server.sh \
		./measure-postgres.test -test.run '^$$' -test.bench 'Latency|Drain|ClaimOverSentRows' -test.benchtime 1x -test.v \
		| grep -E '^(cpu:|Benchmark|    bench_test)' | tee postgres/figures/measure-postgres.txt
	@rm -f measure-postgres.test
	@! grep -E '^(--- )?FAIL' postgres/figures/measure-postgres.txt

# What a team pays on every order (BenchmarkTheWrite): on a durable server
# of the benchmark's own (fsync, full_page_writes, synchronous_commit on), a
# relay running beside,
# orders a second and their p50 and p99 at 1, 8 and 32 producers, the
# order alone and with its outbox row (by Write, by Queue in the order's
# round trip, each with and without the NOTIFY); five interleaved rounds,
# then the relay's wake-up with the NOTIFY and polling every 10 ms without
# it, into postgres/figures/measure-write.txt; then benchstat's table into
# measure-write.stat.txt beside it.
measure-write:
	cd postgres && $(GO) test -c -o ../measure-write.test .
	postgres/with-server.sh bash -c 'for round in 1 2 3 4 5; do ./measure-write.test -test.run "^$$" -test.bench "^BenchmarkTheWrite$$" -test.benchtime 2000x || exit 1; done && \
		./measure-write.test -test.run "^$$" -test.bench "^BenchmarkLatency$$/^wake=(notify|poll-10ms)$$" -test.benchtime 1x' \
		| grep -E '^(goos|goarch|pkg|cpu:|Benchmark|PASS|ok|FAIL|--- )' | tee postgres/figures/measure-write.txt
	@rm -f measure-write.test
	@! grep -E '^(--- )?FAIL' postgres/figures/measure-write.txt
	$(BENCHSTAT) -filter .name:TheWrite -col '/write@(order outbox outbox-no-notify queued queued-no-notify)' postgres/figures/measure-write.txt | tee postgres/figures/measure-write.stat.txt

# The two relays side by side, on one throwaway server (wal_level = logical,
# as with-server.sh sets it): 8 producers for 5 s while the polling relay,
# then the log relay, delivers, six rounds of it (benchstat's medians and
# spreads: one run's p99 is no figure to quote); and the client's CPU for a pass through the
# relay (on a *sql.DB and on a pgxpool), bare pgx, the same statements
# through database/sql, and pipelined pgx (six
# rounds, then benchstat); into
# postgres/figures/measure-relays.txt and .stat.txt, for postgres/README.md
# and REFERENCE.md.
measure-relays:
	cd postgres && $(GO) test -c -o ../measure-relays.test .
	postgres/with-server.sh bash -c 'for round in 1 2 3 4 5 6; do ./measure-relays.test -test.run "^$$" -test.bench "^BenchmarkRelays$$" -test.benchtime 1x -test.v || exit 1; done && \
		for round in 1 2 3 4 5 6; do ./measure-relays.test -test.run "^$$" -test.bench "^BenchmarkPassCPU$$" -test.benchtime 50000x || exit 1; done' \
		| grep -E '^(cpu:|Benchmark|    relays_bench_test)' | tee postgres/figures/measure-relays.txt
	{ $(BENCHSTAT) -filter .name:PassCPU -col '/pass@(pgx relay relay-pgx sql pgx-pipelined)' postgres/figures/measure-relays.txt && \
	  $(BENCHSTAT) -filter .name:Relays -col '/relay@(poll log log-delete log-unmarked)' postgres/figures/measure-relays.txt; } | tee postgres/figures/measure-relays.stat.txt
	@rm -f measure-relays.test
	@! grep -E '^(--- )?FAIL' postgres/figures/measure-relays.txt

# A hot aggregate (BenchmarkHotAggregate): the time of a relay's passes
# over the first 1,000 rows of one aggregate's backlog of 1,000 and of
# 100,000 rows, with PerAggregate and over the whole table, six rounds (in
# each, for each backlog, the two orders one after the other, which goes
# first alternating from round to round, so that the machine's drift falls
# on both alike), and the plan of the claim over the larger backlog (the
# first round's, logged);
# then benchstat's ratios; into postgres/figures/measure-hot.txt and
# .stat.txt, for postgres/REFERENCE.md.
measure-hot:
	cd postgres && $(GO) test -c -o ../measure-hot.test .
	postgres/with-server.sh bash -c 'for round in 1 2 3 4 5 6; do for backlog in 1000 100000; do \
		orders="table aggregate"; [ $$((round % 2)) = 0 ] && orders="aggregate table"; \
		for order in $$orders; do ./measure-hot.test -test.run "^$$" -test.bench "^BenchmarkHotAggregate$$/^backlog=$$backlog$$/^order=$$order$$" \
			-test.benchtime 1x $$([ $$round = 1 ] && echo -test.v) || exit 1; done; done; done' \
		| grep -E '^(cpu:|Benchmark|    hot_test|        )' | tee postgres/figures/measure-hot.txt
	@rm -f measure-hot.test
	@! grep -E '^(--- )?FAIL' postgres/figures/measure-hot.txt
	{ $(BENCHSTAT) -filter .name:HotAggregate -row /backlog -col '/order@(table aggregate)' postgres/figures/measure-hot.txt && \
	  $(BENCHSTAT) -filter .name:HotAggregate -row /order -col '/backlog@(1000 100000)' postgres/figures/measure-hot.txt; } | tee postgres/figures/measure-hot.stat.txt

# The polling relay's drain against watermill-sql's forwarder, the peer a
# team might adopt instead, and against the least a relay's pass sends (the
# claim and the mark on a bare pgx connection): BenchmarkDrain in
# postgres/peerbench, a module of its own so that watermill is no dependency
# of postgres/. Six rounds, each a drain of 2,000, one of 5,000 and one of 20,000 orders
# (PEERBENCH_ORDERS) by every contender in turn and their ratios, and in the
# first the plan of watermill's query for a batch (logged); then benchstat's
# medians; into postgres/figures/measure-watermill.txt
# and .stat.txt, for postgres/REFERENCE.md.
measure-watermill:
	cd postgres/peerbench && $(GO) test -c -o ../../measure-watermill.test .
	postgres/with-server.sh bash -c 'for round in 1 2 3 4 5 6; do ./measure-watermill.test -test.run "^$$" -test.bench "^BenchmarkDrain$$" -test.benchtime 1x \
			$$([ $$round = 1 ] && echo -test.v) || exit 1; done' \
		| grep -E '^(cpu:|Benchmark|--- FAIL|FAIL|    drain_test|        )' | tee postgres/figures/measure-watermill.txt
	@rm -f measure-watermill.test
	@! grep -E '^(--- )?FAIL' postgres/figures/measure-watermill.txt
	$(BENCHSTAT) -filter .name:Drain postgres/figures/measure-watermill.txt | tee postgres/figures/measure-watermill.stat.txt

# A failover on this machine (TestFailover): a primary and a streaming
# standby, each a throwaway server of the test's own, producers, a relay
# (the polling one, then the log relay) and a dual write running, the
# primary killed with SIGKILL and the standby promoted, the relay running
# through it unrestarted; the standby synchronous, then asynchronous and
# behind; then two failovers in a row on a quorum of two standbys, with the
# relays and then the relay process (outbox-relay/) running through both;
# into postgres/figures/failover.txt, for the postgres documents.
failover:
	cd postgres && { echo "cpu: $$(sed -n 's/^model name[[:space:]]*: //p' /proc/cpuinfo | head -1)"; \
		$(GO) test -count=1 -v -run '^TestFailover$$' . 2>&1; } \
		| grep -E '^(cpu:|--- |    --- |    (failover|quorum)_test|ok|FAIL)' | tee figures/failover.txt
	cd outbox-relay && $(GO) test -count=1 -v -run '^TestRelayProcessRunsThroughTwoFailoversOnAQuorum$$' . 2>&1 \
		| grep -E '^(--- |    failover_test|ok|FAIL)' | tee -a ../postgres/figures/failover.txt
	@! grep -E '^(    )?(--- )?FAIL' postgres/figures/failover.txt

# The natsbroker/ module: the outbox end to end through NATS JetStream, which
# its tests embed (each with its store in a temporary folder); then the shop
# program's module, shop/, which holds the SDKs, exporters and
# chromedp, and may import the lesson, so that the outbox modules need none
# of them. The shop runs on RabbitMQ too (-broker rabbitmq), which its tests
# start: installed first where it is missing.
natsbroker: rabbitmq-server
	$(call module-tests,natsbroker)
	$(call module-tests,shop)

# The relay process's module, outbox-relay/: its tests build the command
# and run it as a process against a throwaway PostgreSQL, JetStream servers
# they embed (one taking only TLS with a client certificate and a user)
# and RabbitMQ nodes they start (one with an AMQPS listener), with
# certificates they make, and a PgBouncer of their own in transaction
# pooling; each removed after.
outbox-relay: rabbitmq-server pgbouncer
	$(call module-tests,outbox-relay)

# The kit (kit/, standard library only): it copies the product modules into
# a temporary folder under a team's module path, builds and vets each there,
# and runs a part of their tests in the copies, on the throwaway server.
kit:
	$(call module-tests,kit)

# PgBouncer from Debian's packages, installed where it is missing, its
# service kept from starting, as rabbitmq-server is: the relay process's
# tests and one of postgres/'s start one of their own in front of their
# PostgreSQL.
pgbouncer:
	@test -x /usr/sbin/pgbouncer || { \
		echo "make $(MAKECMDGOALS): PgBouncer is missing; installing Debian's pgbouncer, its service kept from starting"; \
		own=; [ -e /usr/sbin/policy-rc.d ] || { printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d; chmod +x /usr/sbin/policy-rc.d; own=1; }; \
		{ apt-get install -y --no-install-recommends pgbouncer >/dev/null 2>&1 || { apt-get update >/dev/null && apt-get install -y --no-install-recommends pgbouncer >/dev/null; }; }; \
		status=$$?; [ -z "$$own" ] || rm -f /usr/sbin/policy-rc.d; exit $$status; }

# RabbitMQ from Debian's packages, installed where it is missing (apt-get
# install rabbitmq-server, with the package's service kept from starting:
# policy-rc.d); nothing here runs the service it installs.
rabbitmq-server:
	@test -x /usr/lib/rabbitmq/bin/rabbitmq-server || { \
		echo "make rabbitbroker: RabbitMQ is missing; installing Debian's rabbitmq-server, its service kept from starting"; \
		own=; [ -e /usr/sbin/policy-rc.d ] || { printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d; chmod +x /usr/sbin/policy-rc.d; own=1; }; \
		{ apt-get install -y --no-install-recommends rabbitmq-server >/dev/null 2>&1 || { apt-get update >/dev/null && apt-get install -y --no-install-recommends rabbitmq-server >/dev/null; }; }; \
		status=$$?; [ -z "$$own" ] || rm -f /usr/sbin/policy-rc.d; exit $$status; }

# The rabbitbroker module's tests, which start throwaway nodes in temporary
# folders on loopback ports of their own, each with an epmd of its own, and
# stop and remove them.
rabbitbroker: rabbitmq-server
	$(call module-tests,rabbitbroker)

# The kafkabroker/ module: its tests start franz-go's Kafka-protocol cluster
# (kfake, three brokers) themselves, or use the one OUTBOX_KAFKA_BROKERS names.
kafkabroker:
	$(call module-tests,kafkabroker)

# The rabbitbroker figures, into rabbitbroker/figures/measure-rabbitbroker.txt
# (and benchstat's ratios into measure-rabbitbroker.stat.txt beside it): the
# relay's drain rate to a RabbitMQ node (a quorum queue), confirming each
# message against confirms in flight, beside natsbroker's drain to one
# JetStream server on the same rows, syncing before each ack or not (six
# interleaved rounds), then the delay from an order's commit to its
# delivery and to its reservation at 100, 300 and 1,000 orders a second, and
# how busy the machine's CPUs were (once).
measure-rabbitbroker: rabbitmq-server
	cd rabbitbroker && $(GO) test -c -o ../measure-rabbitbroker.test .
	cd natsbroker && $(GO) test -c -o ../measure-natsbroker.test .
	postgres/with-server.sh bash -c 'for round in 1 2 3 4 5 6; do \
		(cd rabbitbroker && ../measure-rabbitbroker.test -test.run "^$$" -test.bench "^BenchmarkDrain$$" -test.benchtime 5000x) || exit 1; \
		(cd natsbroker && ../measure-natsbroker.test -test.run "^$$" -test.bench "^BenchmarkDrain/broker=(one|one-always)$$/ack=(each|batch)$$" -test.benchtime 5000x) || exit 1; done; \
		cd rabbitbroker && ../measure-rabbitbroker.test -test.run "^$$" -test.bench "^BenchmarkLatency$$" -test.benchtime 1x -test.v' \
		| grep -E '^(cpu:|Benchmark|    bench_test|--- FAIL|FAIL)' | tee rabbitbroker/figures/measure-rabbitbroker.txt
	@rm -f measure-rabbitbroker.test measure-natsbroker.test
	@! grep -E '^(--- )?FAIL' rabbitbroker/figures/measure-rabbitbroker.txt
	{ $(BENCHSTAT) -filter .name:Drain -row /broker -col '/ack@(each batch)' rabbitbroker/figures/measure-rabbitbroker.txt && \
	  $(BENCHSTAT) -filter .name:Drain -row /ack -col '/broker@(one-always rabbitmq)' rabbitbroker/figures/measure-rabbitbroker.txt && \
	  $(BENCHSTAT) -filter .name:Drain -row /ack -col '/broker@(one rabbitmq)' rabbitbroker/figures/measure-rabbitbroker.txt; } | tee rabbitbroker/figures/measure-rabbitbroker.stat.txt

# The shop of shop/, to run by hand and curl, on a throwaway
# PostgreSQL with an embedded JetStream whose store is a temporary folder:
# shop migrate first (the schema, the stream and its consumer), then shop
# serve, which checks them. SHOP_ADDR is where it listens. Ctrl-C stops it,
# removes the broker's store, then the server's folder.
# SHOP_NODES=3 runs JetStream as a cluster of three, the stream replicated
# on each, and POST /broker/down then stops one node. SHOP_DATA=FOLDER keeps
# the database (FOLDER/postgres) and the broker's store (FOLDER/jetstream):
# make shop SHOP_DATA=FOLDER again resumes on them, and the outbox catches up
# with whatever was left unsent. SHOP_RELAY=log runs the log relay instead
# of the polling relay (migrate creates its slot). SHOP_BROKER=rabbitmq runs
# the shop on RabbitMQ instead of JetStream (installed where it is missing):
# a node the shop starts, its data in FOLDER/rabbitmq, stopped with the shop.
# SHOP_BROKER=kafka runs it on Kafka: franz-go's Kafka-protocol cluster
# (kfake; no Kafka server installs here) as a process the shop starts, of
# SHOP_NODES brokers, its data in FOLDER/kafka, stopped with the shop.
SHOP_ADDR   ?= 127.0.0.1:8080
SHOP_RELAY  ?= polling
SHOP_NODES  ?= 1
SHOP_DATA   ?=
SHOP_BROKER ?= jetstream
shop: $(if $(filter rabbitmq,$(SHOP_BROKER)),rabbitmq-server)
	@OUTBOX_POSTGRES_DATA=$(if $(SHOP_DATA),$(abspath $(SHOP_DATA))/postgres) SHOP_DATA=$(if $(SHOP_DATA),$(abspath $(SHOP_DATA))) \
	postgres/with-server.sh bash -c 'dir=$$(mktemp -d "$${TMPDIR:-/tmp}/shop.XXXXXX") && trap "rm -rf $$dir" EXIT && \
		store="$${SHOP_DATA:-$$dir}/$(SHOP_BROKER)" && \
		(cd shop && $(GO) build -o "$$dir/shop" .) && \
		"$$dir/shop" migrate -store "$$store" -broker $(SHOP_BROKER) -nodes $(SHOP_NODES) -relay $(SHOP_RELAY) && \
		"$$dir/shop" serve -store "$$store" -broker $(SHOP_BROKER) -nodes $(SHOP_NODES) -addr $(SHOP_ADDR) -relay $(SHOP_RELAY)'

# The shop's live page in a real browser: headless Chromium (Debian's
# chromium, installed here where it is missing) driven by chromedp, on a
# throwaway PostgreSQL, the test built with -tags browser. SCREENSHOT=file
# writes the page as the scenario left it (shop/page.png in its README).
page:
	@command -v chromium >/dev/null || { \
		echo "make page: Chromium is missing; installing Debian's chromium (apt-get install chromium)"; \
		apt-get install -y chromium >/dev/null 2>&1 || { apt-get update >/dev/null && apt-get install -y chromium >/dev/null; }; }
	postgres/with-server.sh bash -c 'cd shop && OUTBOX_SCREENSHOT=$(if $(SCREENSHOT),$(abspath $(SCREENSHOT))) \
		$(GO) test -tags browser -count=1 -run "^TestPage" -v .'

# The knee of the whole pipeline (BenchmarkKnee): orders offered at rising
# rates, 3 s each, through clients, a relay, JetStream and the warehouse's
# consumer, on one server and a cluster of three, with each relay; into
# natsbroker/figures/knee.txt, then drawn by shop/kneeplot (a
# module of its own, for gonum/plot) into natsbroker/figures/knee.png, for
# natsbroker/README.md.
knee:
	cd natsbroker && $(GO) test -c -o ../knee.test .
	postgres/with-server.sh bash -c './knee.test -test.run "^$$" -test.bench "^BenchmarkKnee$$" -test.benchtime 1x -test.timeout 30m' \
		| grep -E '^(cpu:|Benchmark|    knee_test|--- FAIL|FAIL)' | tee natsbroker/figures/knee.txt
	@rm -f knee.test
	@! grep -E '^(--- )?FAIL' natsbroker/figures/knee.txt
	cd shop/kneeplot && $(GO) run . ../../natsbroker/figures/knee.txt ../../natsbroker/figures/knee.png
	$(MAKE) knee-kafka

# Kafka's row of the knee (kafkabroker's BenchmarkKnee, the same harness,
# shoptest.Pipeline): the polling relay to kfake's three brokers and one
# member of the warehouse's group, ack-only, one and batch; into
# kafkabroker/figures/knee.txt, for kafkabroker/README.md. make knee runs it
# after JetStream's.
knee-kafka:
	cd kafkabroker && $(GO) test -c -o ../knee-kafka.test .
	postgres/with-server.sh bash -c './knee-kafka.test -test.run "^$$" -test.bench "^BenchmarkKnee$$" -test.benchtime 1x -test.timeout 30m' \
		| grep -E '^(cpu:|Benchmark|    bench_test|--- FAIL|FAIL)' | tee kafkabroker/figures/knee.txt
	@rm -f knee-kafka.test
	@! grep -E '^(--- )?FAIL' kafkabroker/figures/knee.txt

# The kafkabroker drain figures, into kafkabroker/figures/measure-kafkabroker.txt:
# the polling relay's drain rate to kfake's three brokers (a topic of six
# partitions, three replicas), each ack waited for or a pass's batch at
# once, through a client with kgo's default linger (10 ms) and with none;
# three rounds of 2,000 rows each.
measure-kafkabroker:
	cd kafkabroker && $(GO) test -c -o ../measure-kafkabroker.test .
	postgres/with-server.sh bash -c 'cd kafkabroker && ../measure-kafkabroker.test -test.run "^$$" -test.bench "^BenchmarkDrain$$" -test.benchtime 2000x -test.count 3' \
		| grep -E '^(cpu:|Benchmark|--- FAIL|FAIL)' | tee kafkabroker/figures/measure-kafkabroker.txt
	@rm -f measure-kafkabroker.test
	@! grep -E '^(--- )?FAIL' kafkabroker/figures/measure-kafkabroker.txt

# The natsbroker figures, into natsbroker/figures/measure-natsbroker.txt (and
# benchstat's ratios into measure-natsbroker.stat.txt beside it): the relay's
# drain rate to JetStream, waiting for each ack against the asynchronous
# batch, through one server, one that syncs to disk before each ack
# (sync_interval: always) and a replicated cluster of three, and the cost
# of tracing on the relay's drain (six interleaved rounds, then the ratios),
# and the delay from an order's commit to its reservation, end to end (once:
# 300 orders).
measure-natsbroker:
	cd natsbroker && $(GO) test -c -o ../measure-natsbroker.test .
	postgres/with-server.sh bash -c 'for round in 1 2 3 4 5 6; do \
		./measure-natsbroker.test -test.run "^$$" -test.bench "^Benchmark(Drain|RelayTracing)$$" -test.benchtime 5000x || exit 1; done; \
		./measure-natsbroker.test -test.run "^$$" -test.bench "^BenchmarkLatency$$" -test.benchtime 1x -test.v' \
		| grep -E '^(cpu:|Benchmark|    bench_test|--- FAIL|FAIL)' | tee natsbroker/figures/measure-natsbroker.txt
	@rm -f measure-natsbroker.test
	@! grep -E '^(--- )?FAIL' natsbroker/figures/measure-natsbroker.txt
	{ $(BENCHSTAT) -filter .name:Drain -row /broker -col '/ack@(each batch)' natsbroker/figures/measure-natsbroker.txt && \
	  $(BENCHSTAT) -filter .name:Drain -row /broker -col '/ack@(batch sequence)' natsbroker/figures/measure-natsbroker.txt && \
	  $(BENCHSTAT) -filter .name:Drain -row /ack -col '/broker@(one one-always)' natsbroker/figures/measure-natsbroker.txt && \
	  $(BENCHSTAT) -filter .name:Drain -row /ack -col '/broker@(one cluster3)' natsbroker/figures/measure-natsbroker.txt && \
	  $(BENCHSTAT) -filter .name:Drain -row /ack -col '/broker@(cluster3 cluster3-always)' natsbroker/figures/measure-natsbroker.txt && \
	  $(BENCHSTAT) -filter .name:RelayTracing -col '/trace@(none stored sdk)' natsbroker/figures/measure-natsbroker.txt; } | tee natsbroker/figures/measure-natsbroker.stat.txt
