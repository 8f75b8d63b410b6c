package network

import (
	"context"
	"net/netip"
	"os/exec"
	"strings"
	"testing"
)

func TestCountRulesAndSets(t *testing.T) {
	p := &Pool{cfg: Config{Bridge: "x0", Prefix: "x"}, subnet: netip.MustParsePrefix("10.1.0.0/24"),
		gateway: netip.MustParseAddr("10.1.0.1"), proxyPort: 4242}
	inet, bridge := p.tables(nil)
	for _, c := range []struct {
		name  string
		text  string
		rules int
		sets  int
	}{
		{"inet", inet, 21, 9},
		{"bridge", bridge, 1, 0},
	} {
		if got := countRules(c.text); got != c.rules {
			t.Errorf("%s: countRules = %d, want %d:\n%s", c.name, got, c.rules, c.text)
		}
		if got := len(setNames(c.text)); got != c.sets {
			t.Errorf("%s: %d sets (%v), want %d", c.name, got, setNames(c.text), c.sets)
		}
		fp := lastComment(c.text)
		if !strings.HasPrefix(fp, fingerprintPrefix) || fingerprintPort(fp) != 4242 {
			t.Errorf("%s: fingerprint %q does not name port 4242", c.name, fp)
		}
	}
	// Another port is another fingerprint.
	p.proxyPort = 4243
	if inet2, _ := p.tables(nil); lastComment(inet2) == lastComment(inet) {
		t.Error("the fingerprint does not change with the egress proxy's port")
	}
	if fingerprintPort("a comment of someone else") != 0 {
		t.Error("fingerprintPort read a port from a foreign comment")
	}
}

// TestRestartKeepsTables: a pool started over the tables of a stopped one with the same
// configuration keeps them (no nft run, elements and proxy port unchanged), drops the
// elements of sources that are no slot any more, and replaces tables that were changed
// by hand or whose proxy port is taken.
func TestRestartKeepsTables(t *testing.T) {
	needRoot(t)
	ctx := context.Background()
	p1 := testPool(t, "ntkeep", -1)
	if _, err := p1.Reconcile(ctx, nil); err != nil {
		t.Fatal(err)
	}
	if p1.tablesKept {
		t.Fatal("a first start kept tables that did not exist")
	}
	s, err := p1.Acquire(ctx, false)
	if err != nil {
		t.Fatal(err)
	}
	if err := p1.SetEgress(ctx, s, nil, []netip.Prefix{netip.MustParsePrefix("8.8.8.8/32")}); err != nil {
		t.Fatal(err)
	}
	// An element of a source that is no slot (a slot destroyed while the node was down).
	orphan := "10.89.7.200"
	if err := nft(ctx, "add element inet "+p1.cfg.Bridge+" blocked { "+orphan+" }\n"); err != nil {
		t.Fatal(err)
	}
	port := p1.proxyPort
	if err := p1.Close(ctx); err != nil { // the slot stays, as after a crash
		t.Fatal(err)
	}
	list := func(family string) string {
		out, err := exec.Command("nft", "list", "table", family, p1.cfg.Bridge).CombinedOutput()
		if err != nil {
			t.Fatalf("nft list table %s: %v: %s", family, err, out)
		}
		return string(out)
	}
	handles := func() string {
		out, _ := exec.Command("nft", "-a", "list", "table", "inet", p1.cfg.Bridge).CombinedOutput()
		_, h, _ := strings.Cut(string(out), "# handle ")
		return strings.Fields(h)[0]
	}
	before := handles()

	cfg := p1.cfg
	cfg.PoolSize = -1
	p2, err := New(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	if !p2.tablesKept || p2.proxyPort != port || handles() != before {
		t.Fatalf("restart: kept %v, proxy port %d (was %d), table handle %s (was %s): want the same tables", p2.tablesKept, p2.proxyPort, port, handles(), before)
	}
	kept, err := p2.Reconcile(ctx, map[int]bool{s.Index: false})
	if err != nil {
		t.Fatal(err)
	}
	inet := list("inet")
	if strings.Contains(inet, orphan) {
		t.Errorf("the element of %s, no slot, is still in the kept table:\n%s", orphan, inet)
	}
	if !strings.Contains(inet, s.IP.String()+" . 8.8.8.8") || !strings.Contains(inet, "elements = { "+s.IP.String()+" }") {
		t.Errorf("the kept slot's elements are gone:\n%s", inet)
	}
	if allow, deny := kept[s.Index].Egress(); len(allow) != 0 || len(deny) != 1 {
		t.Errorf("kept slot starts with allow %v deny %v, want what it held", allow, deny)
	}

	// A rule deleted by hand: the next start replaces the tables, elements carried.
	if err := p2.Close(ctx); err != nil {
		t.Fatal(err)
	}
	out, err := exec.Command("nft", "-a", "list", "chain", "inet", cfg.Bridge, "forward").CombinedOutput()
	if err != nil {
		t.Fatalf("%v: %s", err, out)
	}
	_, h, _ := strings.Cut(string(out), "meta nfproto ipv6 drop # handle ")
	if err := nft(ctx, "delete rule inet "+cfg.Bridge+" forward handle "+strings.TrimSpace(strings.Fields(h)[0])+"\n"); err != nil {
		t.Fatal(err)
	}
	p3, err := New(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	if p3.tablesKept || !strings.Contains(list("inet"), "meta nfproto ipv6 drop") {
		t.Fatalf("a table changed by hand was kept:\n%s", list("inet"))
	}
	if !strings.Contains(list("inet"), s.IP.String()+" . 8.8.8.8") {
		t.Errorf("replaced tables lost the surviving slot's elements:\n%s", list("inet"))
	}

	// The proxy's port taken (p3 still listens): new port, new tables.
	p4, err := New(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	if p4.tablesKept || p4.proxyPort == p3.proxyPort {
		t.Errorf("kept tables naming a port another process holds (port %d)", p4.proxyPort)
	}
	for _, p := range []*Pool{p3, p4} {
		if _, err := p.Reconcile(ctx, map[int]bool{s.Index: false}); err != nil {
			t.Fatal(err)
		}
	}
	if err := p4.Release(ctx, s); err != nil {
		t.Fatal(err)
	}
	for _, p := range []*Pool{p3, p4} {
		if err := p.Close(ctx); err != nil {
			t.Fatal(err)
		}
	}
}
