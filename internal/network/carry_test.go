package network

import (
	"context"
	"net/netip"
	"os/exec"
	"slices"
	"strings"
	"testing"

	"github.com/aenv-dev/aenv/internal/sandbox"
)

// listing is `nft -j list table inet` of nftables 1.0.6 with the set shapes the rules use.
const listing = `{"nftables": [{"metainfo": {"version": "1.0.6", "release_name": "Lester Gooch #5", "json_schema_version": 1}},
{"table": {"family": "inet", "name": "t", "handle": 8563}},
{"set": {"family": "inet", "name": "blocked", "table": "t", "type": "ipv4_addr", "handle": 1, "elem": ["10.9.0.2", "10.9.0.3", "10.9.0.9"]}},
{"set": {"family": "inet", "name": "egress_proxy_all", "table": "t", "type": "ipv4_addr", "handle": 4, "elem": ["10.9.0.3"]}},
{"set": {"family": "inet", "name": "egress_proxy_web", "table": "t", "type": "ipv4_addr", "handle": 5}},
{"set": {"family": "inet", "name": "egress_allow", "table": "t", "type": ["ipv4_addr", "ipv4_addr"], "handle": 2, "flags": ["interval"],
 "elem": [{"concat": ["10.9.0.2", {"prefix": {"addr": "1.2.3.0", "len": 24}}]}, {"concat": ["10.9.0.2", "8.8.8.8"]}, {"concat": ["10.9.0.9", {"prefix": {"addr": "0.0.0.0", "len": 0}}]}]}},
{"set": {"family": "inet", "name": "bridges", "table": "t", "type": "ifname", "handle": 6, "elem": ["ntcarbr"]}},
{"chain": {"family": "inet", "table": "t", "name": "input", "handle": 7}}]}`

func TestParseCarried(t *testing.T) {
	a2, a3 := netip.MustParseAddr("10.9.0.2"), netip.MustParseAddr("10.9.0.3")
	got, err := parseCarried([]byte(listing), map[netip.Addr]bool{a2: true, a3: true})
	if err != nil {
		t.Fatal(err)
	}
	want := map[netip.Addr]*carriedSlot{
		// Sorted as SetEgress keeps them; 10.9.0.9 is no surviving slot's and is left out.
		a2: {blocked: true, allow: []netip.Prefix{netip.MustParsePrefix("1.2.3.0/24"), netip.MustParsePrefix("8.8.8.8/32")}},
		a3: {blocked: true, proxy: proxyAll},
	}
	if len(got) != len(want) {
		t.Fatalf("got %d slots, want %d", len(got), len(want))
	}
	for a, w := range want {
		g := got[a]
		if g == nil || g.blocked != w.blocked || g.proxy != w.proxy || !slices.Equal(g.allow, w.allow) || !slices.Equal(g.deny, w.deny) {
			t.Errorf("%s: got %+v, want %+v", a, g, w)
		}
	}

	for _, bad := range []string{
		`not json`,
		`{"nftables": [{"set": {"name": "blocked", "elem": ["10.9.0.300"]}}]}`,
		`{"nftables": [{"set": {"name": "egress_deny", "elem": [{"concat": ["10.9.0.2", {"range": ["1.2.3.4", "1.2.3.9"]}]}]}}]}`,
		`{"nftables": [{"set": {"name": "egress_deny", "elem": [{"concat": ["10.9.0.2"]}]}}]}`,
	} {
		if _, err := parseCarried([]byte(bad), map[netip.Addr]bool{a2: true}); err == nil {
			t.Errorf("parseCarried(%s) accepted it", bad)
		}
	}
}

// TestRestartKeepsSetElements: a new pool over a crashed one's slots re-creates the
// tables with the surviving slots' internet block, destinations and proxy redirect
// already in them, and Reconcile drops those of the slots it removes.
func TestRestartKeepsSetElements(t *testing.T) {
	needRoot(t)
	ctx := context.Background()
	p1 := testPool(t, "ntcar", -1)
	if _, err := p1.Reconcile(ctx, nil); err != nil {
		t.Fatal(err)
	}
	acquire := func(allow bool) *Slot {
		s, err := p1.Acquire(ctx, allow)
		if err != nil {
			t.Fatal(err)
		}
		return s
	}
	web, dns := netip.MustParsePrefix("1.2.3.0/24"), netip.MustParsePrefix("8.8.8.8/32")
	kept0, kept1, gone := acquire(false), acquire(false), acquire(true)
	if err := p1.SetEgress(ctx, kept0, []netip.Prefix{web}, []netip.Prefix{netip.MustParsePrefix("0.0.0.0/0")}); err != nil {
		t.Fatal(err)
	}
	if err := p1.SetProxied(ctx, kept1, sandbox.Egress{AllowDomains: []string{"example.com"}}); err != nil {
		t.Fatal(err)
	}
	if err := p1.SetEgress(ctx, gone, nil, []netip.Prefix{dns}); err != nil {
		t.Fatal(err)
	}
	set := func(name string) string {
		out, err := exec.Command("nft", "list", "set", "inet", p1.cfg.Bridge, name).CombinedOutput()
		if err != nil {
			t.Fatalf("nft list set %s: %v: %s", name, err, out)
		}
		_, elems, _ := strings.Cut(string(out), "elements = {")
		return elems
	}
	has := func(name, elem string) bool { return strings.Contains(set(name), elem) }

	// "Crash": a new pool over p1's slots. Right after New, before Reconcile, everything
	// the slots held is enforced again.
	cfg := p1.cfg
	cfg.PoolSize = -1
	p2, err := New(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		set, elem string
		want      bool
	}{
		{"blocked", kept0.IP.String(), true},
		{"blocked", kept1.IP.String(), true},
		{"egress_allow", kept0.IP.String() + " . 1.2.3.0/24", true},
		{"egress_deny", kept0.IP.String() + " . 0.0.0.0/0", true},
		{"egress_proxy_web", kept1.IP.String(), true},
		{"egress_deny", gone.IP.String() + " . 8.8.8.8", true},
	} {
		if got := has(c.set, c.elem); got != c.want {
			t.Errorf("after New: %s has %q = %v, want %v", c.set, c.elem, got, c.want)
		}
	}

	// kept1 is now allowed the internet; gone is not kept.
	kept, err := p2.Reconcile(ctx, map[int]bool{kept0.Index: false, kept1.Index: true})
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		set, elem string
		want      bool
	}{
		{"blocked", kept0.IP.String(), true},
		{"blocked", kept1.IP.String(), false},
		{"egress_deny", gone.IP.String(), false},
		{"egress_allow", kept0.IP.String() + " . 1.2.3.0/24", true},
	} {
		if got := has(c.set, c.elem); got != c.want {
			t.Errorf("after Reconcile: %s has %q = %v, want %v", c.set, c.elem, got, c.want)
		}
	}
	k0, k1 := kept[kept0.Index], kept[kept1.Index]
	if allow, deny := k0.Egress(); !slices.Equal(allow, []netip.Prefix{web}) || len(deny) != 1 {
		t.Fatalf("kept slot starts with allow %v deny %v, want what it held", allow, deny)
	}
	// The seeded state makes a change replace what the crashed run installed.
	if err := p2.SetEgress(ctx, k0, nil, nil); err != nil {
		t.Fatal(err)
	}
	if has("egress_allow", kept0.IP.String()) || has("egress_deny", kept0.IP.String()) {
		t.Errorf("old destinations of %s left after SetEgress(nil, nil): allow %q deny %q", kept0.IP, set("egress_allow"), set("egress_deny"))
	}
	if err := p2.SetProxied(ctx, k1, sandbox.Egress{}); err != nil {
		t.Fatal(err)
	}
	if has("egress_proxy_web", kept1.IP.String()) {
		t.Errorf("redirect of %s left after SetProxied(none)", kept1.IP)
	}
	for _, s := range kept {
		if err := p2.Release(ctx, s); err != nil {
			t.Fatal(err)
		}
	}
	if err := p2.Close(ctx); err != nil {
		t.Fatal(err)
	}
}
