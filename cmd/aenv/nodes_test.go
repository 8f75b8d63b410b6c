package main

import (
	"strings"
	"testing"
	"time"

	"github.com/aenv-dev/aenv/internal/cluster/gateway"
)

func TestPrintNodes(t *testing.T) {
	now := time.Unix(1_800_000_000, 0)
	var b strings.Builder
	err := printNodes(&b, []gateway.NodeStatus{
		{NodeID: "a", State: "ready", Backend: "oci", Endpoint: "http://10.0.0.1:8000", Sandboxes: 3,
			Capacity: gateway.Resources{CPUCount: 16, Sandboxes: 100}, Allocated: gateway.Resources{CPUCount: 6, MemoryMB: 1536},
			Reserved: gateway.Resources{CPUCount: 2}, LastHeartbeat: now.Add(-2 * time.Second)},
		{NodeID: "b", State: "stale", Backend: "oci", LastHeartbeat: now.Add(-time.Minute)},
	}, now)
	if err != nil {
		t.Fatal(err)
	}
	lines := strings.Split(strings.TrimSpace(b.String()), "\n")
	if len(lines) != 3 {
		t.Fatalf("table:\n%s", b.String())
	}
	for _, want := range [][]string{{"a", "ready", "3/100", "8/16", "1536/-", "2s ago"}, {"b", "stale", "0/-", "1m0s ago"}} {
		row := lines[map[string]int{"a": 1, "b": 2}[want[0]]]
		for _, cell := range want {
			if !strings.Contains(row, cell) {
				t.Errorf("row %q lacks %q", row, cell)
			}
		}
	}
}
