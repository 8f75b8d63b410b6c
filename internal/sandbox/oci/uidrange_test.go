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
	reserve := func(file, owner string, base uint32, ranges int) (uint32, error) {
		r, err := reserveUIDs(file, uidRequest{Owner: owner, Base: base, Ranges: ranges})
		return r.Base, err
	}

	baseA, err := reserve(file, a, 0, 16)
	if err != nil || baseA != uidFloor {
		t.Fatalf("first node: base %d, %v; want %d", baseA, err, uidFloor)
	}
	baseB, err := reserve(file, b, 0, 16)
	if err != nil || baseB != uidFloor+span {
		t.Fatalf("second node: base %d, %v; want %d (after the first block)", baseB, err, uidFloor+span)
	}
	// A restart gets its block back.
	if again, err := reserve(file, a, 0, 16); err != nil || again != baseA {
		t.Fatalf("restart of the first node: base %d, %v; want %d", again, err, baseA)
	}
	// A configured base inside another node's block is refused, naming it; nothing changes.
	before, _ := os.ReadFile(file)
	_, err = reserve(file, c, baseB+idRangeSize, 4)
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
		if _, err := reserve(file, c, bad.base, bad.ranges); err == nil || !strings.Contains(err.Error(), bad.msg) {
			t.Errorf("base %d ranges %d: %v, want %q", bad.base, bad.ranges, err, bad.msg)
		}
	}
	// A configured base clear of the others works.
	if got, err := reserve(file, c, 1<<30, 4); err != nil || got != 1<<30 {
		t.Fatalf("free configured base: %d, %v", got, err)
	}
	// A node whose data directory is gone gives its block up: the next node fits there.
	if err := os.RemoveAll(a); err != nil {
		t.Fatal(err)
	}
	if got, err := reserve(file, node("d"), 0, 16); err != nil || got != baseA {
		t.Fatalf("after the first node's directory went: base %d, %v; want %d", got, err, baseA)
	}
	// An automatic block takes the room after the others and is found again at a restart.
	e := node("e")
	first, err := reserveUIDs(file, uidRequest{Owner: e, Ranges: 1000, Auto: true})
	if err != nil || first.Base != uidFloor+2*span || first.Ranges != 1000 {
		t.Fatalf("automatic block: %v (%d ranges), %v; want %d, 1000 ranges", first, first.Ranges, err, uidFloor+2*span)
	}
	if again, err := reserveUIDs(file, uidRequest{Owner: e, Ranges: 500, Auto: true}); err != nil || again != first {
		t.Fatalf("restart of the automatic node: %v, %v; want %v", again, err, first)
	}
	// A corrupt record is an error, not a silent reset.
	if err := os.WriteFile(file, []byte("{nope"), 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := reserve(file, c, 0, 1); err == nil || !strings.Contains(err.Error(), "remove it") {
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
			r, err := reserveUIDs(file, uidRequest{Owner: d, Ranges: 3})
			if err != nil {
				t.Error(err)
			}
			bases[i] = r.Base
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

func TestAutoUIDRanges(t *testing.T) {
	for _, tc := range []struct {
		mem  uint64
		want int
	}{{0, 256}, {1 << 30, 256}, {23 << 30, 5888}, {64 << 30, 16384}, {1 << 40, 16384}} {
		if got := autoUIDRanges(tc.mem); got != tc.want {
			t.Errorf("autoUIDRanges(%d GiB) = %d, want %d", tc.mem>>30, got, tc.want)
		}
	}
}

// placeUIDs sizes an automatic block to the room there is, keeps a node's earlier block
// (growing it in place, never moving or shrinking it while it is free), and says what
// to do when nothing fits.
func TestPlaceUIDs(t *testing.T) {
	const f, r = uidFloor, idRangeSize
	block := func(owner string, base uint32, ranges uint32) uidReservation {
		return uidReservation{Owner: owner, Base: base, Ranges: ranges}
	}
	auto := uidRequest{Owner: "me", Ranges: 5000, Auto: true}
	for _, tc := range []struct {
		name   string
		req    uidRequest
		prev   *uidReservation
		others []uidReservation
		want   uidReservation
		err    string
	}{
		{name: "empty host", req: auto, want: block("me", f, 5000)},
		{name: "after another node", req: auto, others: []uidReservation{block("x", f, 100)}, want: block("me", f+100*r, 5000)},
		{name: "largest free block when none holds the target", req: auto,
			others: []uidReservation{block("x", f, 100), block("y", f+150*r, 65000)}, want: block("me", f+65150*r, 384)},
		{name: "nothing of the minimum left", req: auto,
			others: []uidReservation{block("x", f, 100), block("y", f+150*r, 65380)}, err: "the largest holds 50; free the blocks"},
		{name: "fixed count that does not fit", req: uidRequest{Owner: "me", Ranges: 200},
			others: []uidReservation{block("x", f, 100), block("y", f+150*r, 65380)}, err: "lower backend.uid_ranges"},
		{name: "earlier block grows in place", req: auto, prev: ptr(block("me", f+100*r, 300)),
			others: []uidReservation{block("x", f, 100)}, want: block("me", f+100*r, 5000)},
		{name: "earlier block grows up to the next node", req: auto, prev: ptr(block("me", f+100*r, 300)),
			others: []uidReservation{block("x", f, 100), block("y", f+500*r, 10)}, want: block("me", f+100*r, 400)},
		{name: "earlier block larger than the target is kept", req: auto, prev: ptr(block("me", f, 8000)), want: block("me", f, 8000)},
		{name: "earlier block taken by another node", req: auto, prev: ptr(block("me", f, 300)),
			others: []uidReservation{block("x", f+100*r, 10)}, want: block("me", f+110*r, 5000)},
		{name: "fixed count changed", req: uidRequest{Owner: "me", Ranges: 50}, prev: ptr(block("me", f+100*r, 30)),
			others: []uidReservation{block("x", f, 100)}, want: block("me", f+100*r, 50)},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := placeUIDs(tc.req, tc.prev, tc.others)
			if tc.err != "" {
				if err == nil || !strings.Contains(err.Error(), tc.err) {
					t.Fatalf("err %v, want one containing %q", err, tc.err)
				}
				return
			}
			if err != nil || got != tc.want {
				t.Fatalf("got %v (%d ranges), %v; want %v (%d ranges)", got, got.Ranges, err, tc.want, tc.want.Ranges)
			}
		})
	}
}

func ptr[T any](v T) *T { return &v }

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
