# The Go edition of the Transactional Outbox example. Needs only Go and make.
#
#   make test T=patterns/enterprise/outbox   gofmt check, go vet, all tests (with -race where cgo is available)
#   make example                             the article's scenario and the crash table, printed
#   make fuzz [FUZZTIME=3m]                  the model-based fuzz test, for a while
#   make bench                               the benchmarks quoted in README.md, and their ratios
#   make lint                                staticcheck (fetched through the Go module proxy)

PATTERN  := patterns/enterprise/outbox
T        ?= $(PATTERN)
GO       ?= go
FUZZTIME ?= 3m
# benchstat, like staticcheck, is a tool run through the module proxy, never a
# dependency of the package.
BENCHSTAT := $(GO) run golang.org/x/perf/cmd/benchstat@v0.0.0-20260908200009-22c9c6c9d4da
# The race detector needs cgo, which Go turns off where it finds no C compiler.
RACE     := $(if $(filter 1,$(shell $(GO) env CGO_ENABLED)),-race)

.PHONY: test pattern example fuzz bench lint

test: pattern
	@bad=$$(gofmt -l .); if [ -n "$$bad" ]; then echo "gofmt would change: $$bad" >&2; exit 1; fi
	$(GO) vet ./...
	$(GO) test $(RACE) -cover -count=1 ./...

pattern:
	@if [ "$(T)" != "$(PATTERN)" ]; then \
		echo "make: T=$(T) is not in this module: it holds $(PATTERN) only" >&2; exit 2; fi

# Without a package argument go test streams the examples' standard error,
# where they copy the transcript and the crash table, to the terminal.
example:
	$(GO) test -count=1 -run '^Example(_crashPoints)?$$'

fuzz:
	$(GO) test -run '^$$' -fuzz '^FuzzModel$$' -fuzztime $(FUZZTIME) -fuzzminimizetime 10s .

# Ten rounds of every benchmark into bench.txt (about a minute on 2 cores),
# then each ratio the README quotes. A round runs each pair one right after the
# other, so that the two sides of a ratio meet the same machine (-count would
# run all rounds of one side first). The test binary is built once.
bench:
	$(GO) test -c -o bench.test .
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
