package oci

import (
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
)

func TestReserveUIDs(t *testing.T) {
	dir := t.TempDir()
	file := filepath.Join(dir, "run", "uid-ranges.json")
	node := func(name string) string {
		d := filepath.Join(dir, name)
		if err := os.MkdirAll(d, 0o755); err != nil {
			t.Fatal(err)
		}
		return d
	}
	a, b, c := node("a"), node("b"), node("c")
	const span = 16 * idRangeSize

	baseA, err := reserveUIDs(file, a, 0, 16)
	if err != nil || baseA != uidFloor {
		t.Fatalf("first node: base %d, %v; want %d", baseA, err, uidFloor)
	}
	baseB, err := reserveUIDs(file, b, 0, 16)
	if err != nil || baseB != uidFloor+span {
		t.Fatalf("second node: base %d, %v; want %d (after the first block)", baseB, err, uidFloor+span)
	}
	// A restart gets its block back.
	if again, err := reserveUIDs(file, a, 0, 16); err != nil || again != baseA {
		t.Fatalf("restart of the first node: base %d, %v; want %d", again, err, baseA)
	}
	// A configured base inside another node's block is refused, naming it; nothing changes.
	before, _ := os.ReadFile(file)
	_, err = reserveUIDs(file, c, baseB+idRangeSize, 4)
	if err == nil || !strings.Contains(err.Error(), "overlaps") || !strings.Contains(err.Error(), b) ||
		!strings.Contains(err.Error(), "backend.uid_base") {
		t.Fatalf("overlapping configured base: %v", err)
	}
	if after, _ := os.ReadFile(file); string(after) != string(before) {
		t.Fatalf("a refused reservation changed the record:\n%s\nwas\n%s", after, before)
	}
	for _, bad := range []struct {
		base   uint32
		ranges int
		msg    string
	}{{1000, 1, "below"}, {1<<32 - idRangeSize, 2, "largest uid"}, {0, 0, "at least 1"}} {
		if _, err := reserveUIDs(file, c, bad.base, bad.ranges); err == nil || !strings.Contains(err.Error(), bad.msg) {
			t.Errorf("base %d ranges %d: %v, want %q", bad.base, bad.ranges, err, bad.msg)
		}
	}
	// A configured base clear of the others works.
	if got, err := reserveUIDs(file, c, 1<<30, 4); err != nil || got != 1<<30 {
		t.Fatalf("free configured base: %d, %v", got, err)
	}
	// A node whose data directory is gone gives its block up: the next node fits there.
	if err := os.RemoveAll(a); err != nil {
		t.Fatal(err)
	}
	if got, err := reserveUIDs(file, node("d"), 0, 16); err != nil || got != baseA {
		t.Fatalf("after the first node's directory went: base %d, %v; want %d", got, err, baseA)
	}
	// A corrupt record is an error, not a silent reset.
	if err := os.WriteFile(file, []byte("{nope"), 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := reserveUIDs(file, c, 0, 1); err == nil || !strings.Contains(err.Error(), "remove it") {
		t.Fatalf("corrupt record: %v", err)
	}
}

// Nodes starting at once (separate opens, as separate processes do) get disjoint blocks.
func TestReserveUIDsConcurrent(t *testing.T) {
	dir := t.TempDir()
	file := filepath.Join(dir, "uid-ranges.json")
	const n = 8
	bases := make([]uint32, n)
	var wg sync.WaitGroup
	for i := range n {
		d := filepath.Join(dir, "node", string(rune('a'+i)))
		if err := os.MkdirAll(d, 0o755); err != nil {
			t.Fatal(err)
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			var err error
			if bases[i], err = reserveUIDs(file, d, 0, 3); err != nil {
				t.Error(err)
			}
		}()
	}
	wg.Wait()
	seen := map[uint32]bool{}
	for _, b := range bases {
		if seen[b] || (b-uidFloor)%(3*idRangeSize) != 0 {
			t.Fatalf("bases overlap or are misaligned: %v", bases)
		}
		seen[b] = true
	}
}

// The configured nameservers become the sandboxes' resolv.conf and the network pool's
// DNS exception; without them the host file's IPv4 nameservers are the exception.
func TestSandboxDNS(t *testing.T) {
	dir := t.TempDir()
	c := Config{DataDir: dir, DNS: []netip.Addr{netip.MustParseAddr("10.1.2.3"), netip.MustParseAddr("9.9.9.9")}}
	if err := c.sandboxDNS(); err != nil {
		t.Fatal(err)
	}
	raw, err := os.ReadFile(c.ResolvConf)
	if err != nil || string(raw) != "nameserver 10.1.2.3\nnameserver 9.9.9.9\n" || fmt.Sprint(c.Network.DNS) != "[10.1.2.3 9.9.9.9]" {
		t.Fatalf("resolv.conf %q (%v), network DNS %v", raw, err, c.Network.DNS)
	}
	host := filepath.Join(dir, "host-resolv.conf")
	if err := os.WriteFile(host, []byte("search x\nnameserver 10.255.255.53\nnameserver fd00::1\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	c = Config{DataDir: dir, ResolvConf: host}
	if err := c.sandboxDNS(); err != nil || c.ResolvConf != host || fmt.Sprint(c.Network.DNS) != "[10.255.255.53]" {
		t.Fatalf("host file: %v, %s, %v", err, c.ResolvConf, c.Network.DNS)
	}
}
