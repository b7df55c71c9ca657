// Command kcluster runs franz-go's Kafka-protocol cluster (kfake) as a
// process of its own, three brokers on the ports given, its data in -dir,
// each produce synced before it is acknowledged, until it is killed: for
// a test that kills the cluster's process and starts it again on its data.
package main

import (
	"flag"
	"fmt"
	"os"
	"os/signal"
	"strconv"
	"strings"
	"syscall"

	"github.com/twmb/franz-go/pkg/kfake"
)

func main() {
	dir := flag.String("dir", "", "the cluster's data folder")
	ports := flag.String("ports", "", "three ports, comma-separated")
	flag.Parse()
	var ps []int
	for p := range strings.SplitSeq(*ports, ",") {
		n, err := strconv.Atoi(p)
		if err != nil {
			fmt.Fprintln(os.Stderr, "kcluster: -ports:", err)
			os.Exit(2)
		}
		ps = append(ps, n)
	}
	c, err := kfake.NewCluster(kfake.NumBrokers(len(ps)), kfake.Ports(ps...), kfake.DataDir(*dir), kfake.SyncWrites())
	if err != nil {
		fmt.Fprintln(os.Stderr, "kcluster:", err)
		os.Exit(1)
	}
	fmt.Println("ready", strings.Join(c.ListenAddrs(), ","))
	stop := make(chan os.Signal, 1)
	signal.Notify(stop, os.Interrupt, syscall.SIGTERM)
	<-stop
	c.Close()
}
