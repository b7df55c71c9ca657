package main

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"os"
	"slices"
	"strings"
	"time"

	"example.com/patterns/enterprise/outbox/postgres"
)

// broker is the relay's broker, whichever it is: what migrate provisions,
// what run checks and publishes to, and what cleanup must respect.
type broker interface {
	// Provision makes what the relay publishes to (a stream; exchanges and
	// queues) and says what it made.
	Provision(ctx context.Context) (string, error)
	// Check reports whether the broker answers and what the relay
	// publishes to is as configured, changing nothing.
	Check(ctx context.Context) error
	// Publisher is the relays' MessageBroker.
	Publisher() postgres.MessageBroker
	// CheckRetention refuses a -processed-retention shorter than the broker
	// may still deliver a message, where it can tell.
	CheckRetention(ctx context.Context, retention time.Duration) error
	// DuplicateWindow is how long after the broker took a message it drops
	// another with the same key as a copy: 0 for a broker that drops none.
	DuplicateWindow(ctx context.Context) (time.Duration, error)
	// ForgetProcessed forgets the consumers' keys older than retention.
	ForgetProcessed(ctx context.Context, outbox *postgres.Outbox[postgres.SQLTx], retention time.Duration) (int64, error)
	Close()
}

// refusal is the error of a broker that refused the relay's TLS handshake
// or credentials, or of a TLS file that cannot be used: no retry mends it,
// so the relay stops.
type refusal struct{ err error }

func (r refusal) Error() string { return r.err.Error() }
func (r refusal) Unwrap() error { return r.err }

// refused is fmt.Errorf's error, as a refusal.
func refused(format string, args ...any) error { return refusal{fmt.Errorf(format, args...)} }

// isRefused says whether err is, or wraps, a refusal.
func isRefused(err error) bool {
	var r refusal
	return errors.As(err, &r)
}

// dialBroker connects to c's broker once. A refusal (isRefused) is a
// certificate or a credential the server refused; any other error, a
// server that did not answer, worth trying again.
func dialBroker(ctx context.Context, c config) (broker, error) {
	return c.brokers[c.broker].dial(ctx, c.cloudEvents)
}

// brokerKind is a broker the relay can publish to. Each registers itself
// from a file of its own (nats.go, rabbitmq.go, kafka.go), so that a copy
// of the relay that leaves a broker's file out (the kit's, for a team that
// uses one broker) builds without that broker's module.
type brokerKind struct {
	name    string                        // the -broker value
	rank    int                           // where usage lists it; the first registered is the default
	module  string                        // the module of its adapter, as version names it
	version string                        // that module's version
	flags   func(s *settings) brokerFlags // registers its flags on s
}

// brokerFlags is one broker's flags: checked together by parse, and how
// the relay connects.
type brokerFlags interface {
	check() []error
	dial(ctx context.Context, cloudEvents string) (broker, error)
}

// brokerKinds are the registered brokers, by rank.
var brokerKinds []brokerKind

// registerBroker adds k to brokerKinds; each broker's file calls it from
// its init.
func registerBroker(k brokerKind) {
	brokerKinds = append(brokerKinds, k)
	slices.SortFunc(brokerKinds, func(a, b brokerKind) int { return a.rank - b.rank })
}

// brokerNames are the registered brokers' names, "nats, rabbitmq or
// kafka".
func brokerNames() string {
	names := make([]string, len(brokerKinds))
	for i, k := range brokerKinds {
		names[i] = k.name
	}
	if len(names) < 2 {
		return strings.Join(names, "")
	}
	return strings.Join(names[:len(names)-1], ", ") + " or " + names[len(names)-1]
}

// tlsConfig is a client's TLS configuration from PEM files: the CA's
// certificates (the system's if ""), the client's certificate and key (none
// if ""), and the name the server's certificate must carry ("" for the
// URL's host). The flags named in its errors are prefix's.
func tlsConfig(prefix, ca, cert, key, serverName string) (*tls.Config, error) {
	cfg := &tls.Config{MinVersion: tls.VersionTLS12, ServerName: serverName}
	if ca != "" {
		pem, err := os.ReadFile(ca)
		if err != nil {
			return nil, fmt.Errorf("-%s-ca: cannot read the file", prefix)
		}
		cfg.RootCAs = x509.NewCertPool()
		if !cfg.RootCAs.AppendCertsFromPEM(pem) {
			return nil, fmt.Errorf("-%s-ca: no PEM certificate in the file", prefix)
		}
	}
	if cert != "" {
		pair, err := tls.LoadX509KeyPair(cert, key)
		if err != nil {
			return nil, fmt.Errorf("-%s-cert, -%s-key: %w", prefix, prefix, err)
		}
		cfg.Certificates = []tls.Certificate{pair}
	}
	return cfg, nil
}

// refusedTLS says whether err is a TLS handshake that failed: a server
// certificate the relay does not trust, or a client certificate the server
// does not.
func refusedTLS(err error) bool {
	var verify *tls.CertificateVerificationError
	var alert tls.AlertError
	var unknown x509.UnknownAuthorityError
	var host x509.HostnameError
	return errors.As(err, &verify) || errors.As(err, &alert) || errors.As(err, &unknown) || errors.As(err, &host) ||
		strings.Contains(err.Error(), "tls: ") || strings.Contains(err.Error(), "tls error")
}
