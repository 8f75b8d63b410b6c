package network

import (
	"context"
	"net"
	"os/exec"
	"strings"
	"testing"

	"github.com/vishvananda/netlink"
)

// TestSlotsAcrossBridges: with one port per bridge every slot gets a bridge of its own
// (as the 1001st slot does with the default): the host reaches each sandbox, sandboxes on
// different bridges cannot reach each other, per-slot rules (no internet) still apply,
// and release and teardown remove the extra bridges' routes and the bridges.
func TestSlotsAcrossBridges(t *testing.T) {
	needRoot(t)
	ctx := context.Background()
	cfg := Config{Bridge: "ntshbr", Subnet: "10.89.8.0/24", Prefix: "ntsh", PoolSize: -1, BridgePorts: 1}
	p, err := New(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := p.Teardown(ctx); err != nil {
			t.Errorf("teardown: %v", err)
		}
		assertNoLeftovers(t, cfg.Prefix, cfg.Bridge)
		links, _ := netlink.LinkList()
		for _, l := range links {
			if strings.HasPrefix(l.Attrs().Name, cfg.Bridge+"-") {
				t.Errorf("leftover bridge %s", l.Attrs().Name)
			}
		}
	})
	if _, err := p.Reconcile(ctx, nil); err != nil {
		t.Fatal(err)
	}
	var slots []*Slot
	for i, allow := range []bool{true, true, false} {
		s, err := p.Acquire(ctx, allow)
		if err != nil {
			t.Fatal(err)
		}
		slots = append(slots, s)
		want := []string{"ntshbr", "ntshbr-1", "ntshbr-2"}[i]
		if s.Bridge != want || s.Gateway != p.Gateway() {
			t.Fatalf("slot %d on %s (gateway %s), want %s (%s)", s.Index, s.Bridge, s.Gateway, want, p.Gateway())
		}
		if l, err := netlink.LinkByName(s.HostVeth); err != nil || l.Attrs().MasterIndex == 0 {
			t.Fatalf("veth %s: %v", s.HostVeth, err)
		} else if br, err := netlink.LinkByIndex(l.Attrs().MasterIndex); err != nil || br.Attrs().Name != want {
			t.Fatalf("veth %s is a port of %v (%v), want %s", s.HostVeth, br, err, want)
		}
	}
	// Listeners in every sandbox; the host reaches each one (how the node talks to envd).
	addrs := make([]string, len(slots))
	for i, s := range slots {
		if err := inNetns(t, s.NetnsPath, func() error {
			_, addrs[i] = listen(t, net.JoinHostPort(s.IP.String(), "0"))
			return nil
		}); err != nil {
			t.Fatal(err)
		}
		if err := reach(addrs[i]); err != nil {
			t.Errorf("host -> %s on %s: %v", addrs[i], s.Bridge, err)
		}
	}
	// Across bridges the host routes between sandboxes, and the rules must drop it.
	for _, c := range [][2]int{{0, 1}, {1, 2}, {2, 0}} {
		from, to := slots[c[0]], addrs[c[1]]
		if err := inNetns(t, from.NetnsPath, func() error { return dialWithin(to, blockedDial) }); err == nil {
			t.Errorf("sandbox on %s reached %s on %s", from.Bridge, to, slots[c[1]].Bridge)
		}
	}
	out, err := exec.Command("nft", "list", "set", "inet", cfg.Bridge, "blocked").CombinedOutput()
	if err != nil || !strings.Contains(string(out), slots[2].IP.String()) {
		t.Fatalf("blocked set (%v): %s", err, out)
	}
	out, err = exec.Command("nft", "list", "set", "inet", cfg.Bridge, "bridges").CombinedOutput()
	if err != nil || !strings.Contains(string(out), `"ntshbr-2"`) {
		t.Fatalf("bridges set (%v): %s", err, out)
	}
	for _, s := range slots {
		if err := p.Release(ctx, s); err != nil {
			t.Fatal(err)
		}
	}
	routes, _ := netlink.RouteList(nil, netlink.FAMILY_V4)
	for _, r := range routes {
		if r.Dst != nil && r.Dst.IP.Equal(slots[1].IP.AsSlice()) {
			t.Errorf("route to released slot %s left: %v", slots[1].IP, r)
		}
	}
}

// TestShardNameTooLong: a bridge name with no room for the extra bridges' suffix is
// refused when an extra bridge is first needed, naming the key to change.
func TestShardNameTooLong(t *testing.T) {
	p := &Pool{cfg: Config{Bridge: "abcdefghijklmn", BridgePorts: 1000}, shards: map[string]bool{}}
	name := p.bridgeFor(1000)
	if name != "abcdefghijklmn-1" {
		t.Fatalf("bridgeFor(1000) = %q", name)
	}
	if got := p.bridgeFor(999); got != "abcdefghijklmn" {
		t.Fatalf("bridgeFor(999) = %q", got)
	}
	err := p.ensureShard(context.Background(), name)
	if err == nil || !strings.Contains(err.Error(), "network.bridge") {
		t.Fatalf("ensureShard(%q) = %v, want an error naming network.bridge", name, err)
	}
}
