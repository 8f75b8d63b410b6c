package network

import (
	"context"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"slices"
	"strings"
	"testing"
	"time"
)

// pp parses CIDR prefixes (nil for none).
func pp(ss ...string) []netip.Prefix {
	var out []netip.Prefix
	for _, s := range ss {
		out = append(out, netip.MustParsePrefix(s))
	}
	return out
}

func TestFoldPrefixes(t *testing.T) {
	tests := []struct {
		name string
		in   []netip.Prefix
		want []netip.Prefix
	}{
		{"empty", nil, nil},
		{"nested folded", pp("10.1.0.0/16", "10.0.0.0/8", "10.1.2.3/32"), pp("10.0.0.0/8")},
		{"disjoint sorted", pp("192.168.0.0/16", "8.8.8.8/32"), pp("8.8.8.8/32", "192.168.0.0/16")},
		{"duplicates", pp("1.2.3.4/32", "1.2.3.4/32"), pp("1.2.3.4/32")},
		{"all traffic wins", pp("1.2.3.4/32", "0.0.0.0/0"), pp("0.0.0.0/0")},
		{"ipv6 ignored", pp("2001:db8::/32", "1.1.1.1/32"), pp("1.1.1.1/32")},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			if got := foldPrefixes(tc.in); !slices.Equal(got, tc.want) {
				t.Fatalf("foldPrefixes(%v) = %v, want %v", tc.in, got, tc.want)
			}
		})
	}
}

// remoteNetns makes a namespace that stands for a host outside the node: reachable from
// sandboxes only by routing through the host (forward chain), with listeners on two
// addresses of one /24. It returns the two listeners' addresses.
func remoteNetns(t *testing.T, name, hostVeth string) (a, b string) {
	t.Helper()
	run := func(args ...string) {
		t.Helper()
		if out, err := exec.Command("ip", args...).CombinedOutput(); err != nil {
			t.Fatalf("ip %v: %v: %s", args, err, out)
		}
	}
	t.Cleanup(func() {
		_ = exec.Command("ip", "link", "del", hostVeth).Run()
		_ = exec.Command("ip", "netns", "del", name).Run()
	})
	run("netns", "add", name)
	run("link", "add", hostVeth, "type", "veth", "peer", "name", "eth0", "netns", name)
	run("addr", "add", "10.97.7.1/24", "dev", hostVeth)
	run("link", "set", hostVeth, "up")
	run("-n", name, "addr", "add", "10.97.7.2/24", "dev", "eth0")
	run("-n", name, "addr", "add", "10.97.7.3/24", "dev", "eth0")
	run("-n", name, "link", "set", "eth0", "up")
	run("-n", name, "link", "set", "lo", "up")
	for _, ip := range []string{"10.97.7.2", "10.97.7.3"} {
		var addr string
		if err := inNetns(t, "/run/netns/"+name, func() error {
			_, addr = listen(t, net.JoinHostPort(ip, "0"))
			return nil
		}); err != nil {
			t.Fatal(err)
		}
		if a == "" {
			a = addr
		} else {
			b = addr
		}
	}
	return a, b
}

// A sandbox's allowOut/denyOut are enforced on traffic it routes through the host, with
// allowOut winning over denyOut and over no-internet; changes apply live; a released
// slot leaves no elements behind.
func TestEgressEnforced(t *testing.T) {
	needRoot(t)
	ctx := context.Background()
	// The remote stands in for a private network the node's operator opened.
	cfg := Config{Bridge: "ntegrbr", Subnet: "10.96.7.0/24", Prefix: "ntegr", PoolSize: -1, AllowRanges: pp("10.97.7.0/24")}
	p, err := New(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := p.Teardown(context.Background()); err != nil {
			t.Errorf("teardown: %v", err)
		}
		assertNoLeftovers(t, cfg.Prefix, cfg.Bridge)
	})
	if _, err := p.Reconcile(ctx, nil); err != nil {
		t.Fatal(err)
	}
	remoteA, remoteB := remoteNetns(t, "ntegr-remote", "ntegrr0")
	s, err := p.Acquire(ctx, true)
	if err != nil {
		t.Fatal(err)
	}
	// A success may need a retry (ARP, a veth's carrier coming up); a failure is
	// checked with one dial, so a rule that works only sometimes still fails the test.
	reach := func(addr string, want bool) bool {
		deadline := time.Now().Add(3 * time.Second)
		for {
			ok := inNetns(t, s.NetnsPath, func() error { return dial(addr) }) == nil
			if ok || !want || time.Now().After(deadline) {
				return ok
			}
			time.Sleep(100 * time.Millisecond)
		}
	}
	steps := []struct {
		name         string
		internet     bool
		allow, deny  []netip.Prefix
		wantA, wantB bool
	}{
		{"no rules", true, nil, nil, true, true},
		{"deny the /24", true, nil, pp("10.97.7.0/24"), false, false},
		{"allowOut exception inside denyOut", true, pp("10.97.7.3/32"), pp("10.97.7.0/24"), false, true},
		{"nested deny entries", true, nil, pp("10.97.7.2/32", "10.97.0.0/16"), false, false},
		{"deny all traffic", true, pp("10.97.7.2/32"), pp("0.0.0.0/0"), true, false},
		{"no internet blocks", false, nil, nil, false, false},
		{"allowOut exception without internet", false, pp("10.97.7.3/32"), nil, false, true},
		{"back to open", true, nil, nil, true, true},
	}
	for _, st := range steps {
		if err := p.SetEgress(ctx, s, st.allow, st.deny); err != nil {
			t.Fatalf("%s: %v", st.name, err)
		}
		if err := p.SetInternet(ctx, s, st.internet); err != nil {
			t.Fatalf("%s: %v", st.name, err)
		}
		if a, b := reach(remoteA, st.wantA), reach(remoteB, st.wantB); a != st.wantA || b != st.wantB {
			t.Errorf("%s: reach %s=%v %s=%v, want %v %v", st.name, remoteA, a, remoteB, b, st.wantA, st.wantB)
		}
	}

	if err := p.SetEgress(ctx, s, pp("10.97.7.3/32"), pp("10.97.7.0/24")); err != nil {
		t.Fatal(err)
	}
	if err := p.Release(ctx, s); err != nil {
		t.Fatal(err)
	}
	for _, set := range []string{"egress_allow", "egress_deny"} {
		out, err := exec.Command("nft", "list", "set", "inet", p.cfg.Bridge, set).CombinedOutput()
		if err != nil || strings.Contains(string(out), s.IP.String()) {
			t.Fatalf("%s after release (%v): %s", set, err, out)
		}
	}
}

// BenchmarkSetEgress measures one policy change of a slot (an nft transaction) and a
// no-op re-apply (what every launch of a sandbox without rules costs).
func BenchmarkSetEgress(b *testing.B) {
	if os.Geteuid() != 0 {
		b.Skip("needs root (netns, veth, nftables)")
	}
	ctx := context.Background()
	p, err := New(ctx, Config{Bridge: "ntegbbr", Subnet: "10.96.7.0/24", Prefix: "ntegb", PoolSize: -1})
	if err != nil {
		b.Fatal(err)
	}
	defer p.Teardown(ctx)
	if _, err := p.Reconcile(ctx, nil); err != nil {
		b.Fatal(err)
	}
	s, err := p.Acquire(ctx, true)
	if err != nil {
		b.Fatal(err)
	}
	rules := [][]netip.Prefix{
		{netip.MustParsePrefix("10.0.0.0/8"), netip.MustParsePrefix("192.168.0.0/16")},
		{netip.MustParsePrefix("0.0.0.0/0")},
	}
	b.Run("change", func(b *testing.B) {
		for i := range b.N {
			if err := p.SetEgress(ctx, s, rules[i%2][:1], rules[(i+1)%2]); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("unchanged", func(b *testing.B) {
		for range b.N {
			if err := p.SetEgress(ctx, s, nil, rules[1]); err != nil {
				b.Fatal(err)
			}
		}
	})
}
