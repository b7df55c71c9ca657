package main

import "testing"

// The ports a broker's nodes get are all different: 2,000 sets of six, as
// a cluster of three takes, with no port twice in a set. (Caught: ports
// picked one after the other, each listener closed at once, which held a
// port twice in about one set of six in five hundred here; with 2,000 sets
// such a set turns up in almost every run.)
func TestFreePortsAreAllDifferent(t *testing.T) {
	for set := range 2000 {
		ports, err := freePorts(6)
		if err != nil {
			t.Fatal(err)
		}
		seen := map[int]bool{}
		for _, p := range ports {
			if seen[p] {
				t.Fatalf("set %d: port %d twice in %v", set, p, ports)
			}
			seen[p] = true
		}
	}
}
