// Command kcluster runs franz-go's Kafka-protocol cluster (kfake) as a
// process of its own, as kafkatest.Serve does: brokers on the ports given,
// its data in -dir, each produce synced before it is acknowledged, until
// it is stopped or killed: for a test that kills the cluster's process and
// starts it again on its data.
package main

import (
	"fmt"
	"os"

	"example.com/patterns/enterprise/outbox/kafkabroker/kafkatest"
)

func main() {
	if err := kafkatest.Serve(os.Args[1:], os.Stdout); err != nil {
		fmt.Fprintln(os.Stderr, "kcluster:", err)
		os.Exit(1)
	}
}
