package network

import (
	"context"
	"net"
	"net/netip"
	"os/exec"
	"strconv"
	"testing"
	"time"
)

// infraRemote makes a namespace behind host veth hostVeth holding, for each /24 given
// as "a.b.c", the address a.b.c.<last> with a TCP listener (port 0, or 53 for dnsNet),
// while the host side gets a.b.c.1. It returns the listeners' addresses by /24.
func infraRemote(t *testing.T, name, hostVeth string, nets map[string]int, dnsNet string) map[string]string {
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
	run("link", "set", hostVeth, "up")
	run("-n", name, "link", "set", "eth0", "up")
	run("-n", name, "link", "set", "lo", "up")
	out := map[string]string{}
	for n, last := range nets {
		run("addr", "add", n+".1/24", "dev", hostVeth)
		ip := n + "." + strconv.Itoa(last)
		run("-n", name, "addr", "add", ip+"/24", "dev", "eth0")
		port := "0"
		if n == dnsNet {
			port = "53"
		}
		if err := inNetns(t, "/run/netns/"+name, func() error {
			_, out[n] = listen(t, net.JoinHostPort(ip, port))
			return nil
		}); err != nil {
			t.Fatal(err)
		}
	}
	return out
}

// Sandboxes reach public addresses, a range the node allows and its DNS server on port
// 53, and nothing in the infrastructure ranges: link-local (cloud metadata), RFC 1918,
// CGNAT, the host's own addresses, even when the sandbox's allowOut names them.
func TestInfraDeny(t *testing.T) {
	needRoot(t)
	ctx := context.Background()
	cfg := Config{Bridge: "ntinfbr", Subnet: "10.96.201.0/24", Prefix: "ntinf", PoolSize: -1,
		AllowRanges: pp("10.97.202.0/24"), DNS: []netip.Addr{netip.MustParseAddr("10.97.203.53")}}
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
	addr := infraRemote(t, "ntinf-remote", "ntinfr0", map[string]int{
		"169.254.77": 254, "10.97.201": 2, "172.31.197": 2, "192.168.207": 2, "100.64.197": 2,
		"10.97.202": 2, "198.51.100": 2, "10.97.203": 53,
	}, "10.97.203")
	s, err := p.Acquire(ctx, true)
	if err != nil {
		t.Fatal(err)
	}
	// The host reaches every listener: what the sandbox fails to reach is there.
	for n, a := range addr {
		if err := reach(a); err != nil {
			t.Fatalf("control: host -> %s (%s): %v", a, n, err)
		}
	}
	_, dnsOther := listenIn(t, "/run/netns/ntinf-remote", "10.97.203.53:0")
	hostOwn := net.JoinHostPort("10.97.201.1", "0")
	_, hostOwn = listen(t, hostOwn)

	try := func(a string, want bool) {
		t.Helper()
		if want {
			deadline := time.Now().Add(3 * time.Second)
			for {
				err := inNetns(t, s.NetnsPath, func() error { return dial(a) })
				if err == nil {
					return
				}
				if time.Now().After(deadline) {
					t.Errorf("sandbox cannot reach %s: %v", a, err)
					return
				}
				time.Sleep(100 * time.Millisecond)
			}
		}
		if err := inNetns(t, s.NetnsPath, func() error { return dialWithin(a, blockedDial) }); err == nil {
			t.Errorf("sandbox reached %s", a)
		}
	}
	check := func() {
		t.Helper()
		try(addr["198.51.100"], true) // stands in for the public internet
		try(addr["10.97.202"], true)  // the node allows this range
		try(addr["10.97.203"], true)  // the node's DNS server, port 53
		for _, a := range []string{addr["169.254.77"], addr["10.97.201"], addr["172.31.197"], addr["192.168.207"],
			addr["100.64.197"], dnsOther, hostOwn} {
			try(a, false)
		}
	}
	check()
	// allowOut keeps its meaning for public addresses but cannot open infrastructure.
	if err := p.SetEgress(ctx, s, pp("169.254.77.254/32", "10.97.201.0/24", "192.168.0.0/16"), pp("198.51.100.0/24")); err != nil {
		t.Fatal(err)
	}
	try(addr["198.51.100"], false)
	try(addr["169.254.77"], false)
	try(addr["10.97.201"], false)
	try(addr["192.168.207"], false)
	if err := p.SetEgress(ctx, s, nil, nil); err != nil {
		t.Fatal(err)
	}
	check()
}

func TestInfraConfigValidation(t *testing.T) {
	for _, c := range []Config{
		{Bridge: "ntinfbad", AllowRanges: pp("fc00::/7")},
		{Bridge: "ntinfbad", DNS: []netip.Addr{netip.MustParseAddr("fe80::1")}},
	} {
		if _, err := New(context.Background(), c); err == nil {
			t.Fatalf("config %+v accepted", c)
		}
	}
}

// listenIn listens on addr inside the namespace at path.
func listenIn(t *testing.T, path, addr string) (net.Listener, string) {
	t.Helper()
	var l net.Listener
	var got string
	if err := inNetns(t, path, func() error {
		l, got = listen(t, addr)
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	return l, got
}
