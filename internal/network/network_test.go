package network

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"
)

func needRoot(t *testing.T) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root (netns, veth, nftables)")
	}
	if _, err := exec.LookPath("nft"); err != nil {
		t.Skip("needs nft (Debian package nftables)")
	}
}

// testPool makes a pool with names no other test package uses and removes everything
// it made when the test ends, whatever happened.
func testPool(t *testing.T, name string, size int) *Pool {
	t.Helper()
	return testPoolWith(t, Config{Bridge: name + "br", Subnet: "10.89.7.0/24", Prefix: name, PoolSize: size})
}

// testPoolWith is testPool with the whole configuration given.
func testPoolWith(t *testing.T, cfg Config) *Pool {
	t.Helper()
	p, err := New(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := p.Teardown(context.Background()); err != nil {
			t.Errorf("teardown: %v", err)
		}
		assertNoLeftovers(t, cfg.Prefix, cfg.Bridge)
	})
	return p
}

func assertNoLeftovers(t *testing.T, prefix, bridge string) {
	t.Helper()
	if ents, err := os.ReadDir("/run/netns"); err == nil {
		for _, e := range ents {
			if strings.HasPrefix(e.Name(), prefix+"-") {
				t.Errorf("leftover netns %s", e.Name())
			}
		}
	}
	links, _ := netlink.LinkList()
	for _, l := range links {
		n := l.Attrs().Name
		if strings.HasPrefix(n, prefix+"h") || n == bridge {
			t.Errorf("leftover link %s", n)
		}
	}
	if out, _ := exec.Command("nft", "list", "tables").CombinedOutput(); strings.Contains(string(out), " "+bridge+"\n") {
		t.Errorf("leftover nft table %s", bridge)
	}
}

// inNetns runs fn on a thread switched into the namespace at path; sockets fn creates
// stay in that namespace.
func inNetns(t *testing.T, path string, fn func() error) error {
	t.Helper()
	errc := make(chan error, 1)
	go func() {
		runtime.LockOSThread() // never unlocked: the thread dies with the goroutine
		ns, err := netns.GetFromPath(path)
		if err != nil {
			errc <- err
			return
		}
		defer ns.Close()
		if err := netns.Set(ns); err != nil {
			errc <- err
			return
		}
		errc <- fn()
	}()
	return <-errc
}

// listen starts a TCP echo-less acceptor and returns its address.
func listen(t *testing.T, addr string) (net.Listener, string) {
	t.Helper()
	l, err := net.Listen("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			c.Write([]byte("hi"))
			c.Close()
		}
	}()
	return l, l.Addr().String()
}

func dial(addr string) error {
	c, err := net.DialTimeout("tcp", addr, 300*time.Millisecond)
	if err != nil {
		return err
	}
	defer c.Close()
	buf := make([]byte, 2)
	c.SetReadDeadline(time.Now().Add(time.Second))
	if _, err := c.Read(buf); err != nil {
		return err
	}
	return nil
}

// dialWithin connects to addr and reads the listener's greeting, each within timeout.
func dialWithin(addr string, timeout time.Duration) error {
	c, err := net.DialTimeout("tcp", addr, timeout)
	if err != nil {
		return err
	}
	defer c.Close()
	buf := make([]byte, 2)
	c.SetReadDeadline(time.Now().Add(timeout))
	if _, err := c.Read(buf); err != nil {
		return err
	}
	return nil
}

// Timeouts for connectivity checks. A path that must work is retried until reachWithin
// passes, so a loaded host (a load average of 39 made a single 3 s dial time out) delays
// it instead of failing it. A path that must be blocked gets one attempt of blockedDial:
// long enough that a slow but open path would answer, so it is not mistaken for a block.
const (
	reachWithin = 60 * time.Second
	reachDial   = 3 * time.Second
	blockedDial = 3 * time.Second
)

// reach dials addr until it answers or reachWithin passes, and returns the last error.
func reach(addr string) error {
	deadline := time.Now().Add(reachWithin)
	for {
		err := dialWithin(addr, reachDial)
		if err == nil || time.Now().After(deadline) {
			return err
		}
		time.Sleep(100 * time.Millisecond)
	}
}

func TestConfigValidation(t *testing.T) {
	tests := []struct {
		name string
		cfg  Config
	}{
		{"bridge too long", Config{Bridge: "abcdefghijklmnopq"}},
		{"bridge bad chars", Config{Bridge: "br/0"}},
		{"prefix too long", Config{Prefix: "abcdefghi"}},
		{"bad subnet", Config{Subnet: "10.88.0.0/33", Bridge: "aenvbad0"}},
		{"ipv6 subnet", Config{Subnet: "fd00::/64", Bridge: "aenvbad0"}},
		{"tiny subnet", Config{Subnet: "10.88.0.0/30", Bridge: "aenvbad0"}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			if _, err := New(context.Background(), tc.cfg); err == nil {
				t.Fatal("want error")
			}
		})
	}
	if _, err := netlink.LinkByName("aenvbad0"); err == nil {
		t.Fatal("rejected config created a bridge")
	}
}

func TestSlotConnectivityAndIsolation(t *testing.T) {
	needRoot(t)
	ctx := context.Background()
	p := testPool(t, "ntiso", 1)
	if _, err := p.Reconcile(ctx, nil); err != nil {
		t.Fatal(err)
	}
	a, err := p.Acquire(ctx, true)
	if err != nil {
		t.Fatal(err)
	}
	b, err := p.Acquire(ctx, false)
	if err != nil {
		t.Fatal(err)
	}
	if a.IP == b.IP || !p.Subnet().Contains(a.IP) || a.Gateway != netip.MustParseAddr("10.89.7.1") {
		t.Fatalf("bad addresses a=%v b=%v gw=%v", a.IP, b.IP, a.Gateway)
	}
	// The sandbox's namespace has netnsSysctls set.
	if err := inNetns(t, a.NetnsPath, func() error {
		for k, want := range netnsSysctls {
			v, err := os.ReadFile("/proc/sys/net/ipv4/" + k)
			if err != nil {
				return err
			}
			if got := strings.Join(strings.Fields(string(v)), " "); got != want {
				t.Errorf("in %s: net/ipv4/%s = %q, want %q", a.Netns, k, got, want)
			}
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	// The host ends carry no IPv6 (no routes in the host's table per slot).
	for _, s := range []*Slot{a, b} {
		if v, err := os.ReadFile("/proc/sys/net/ipv6/conf/" + s.HostVeth + "/disable_ipv6"); err == nil && strings.TrimSpace(string(v)) != "1" {
			t.Errorf("%s: disable_ipv6 = %q, want 1", s.HostVeth, v)
		}
		l, err := netlink.LinkByName(s.HostVeth)
		if err != nil {
			t.Fatal(err)
		}
		if addrs, err := netlink.AddrList(l, netlink.FAMILY_V6); err != nil || len(addrs) > 0 {
			t.Errorf("%s: IPv6 addresses %v (err %v), want none", s.HostVeth, addrs, err)
		}
	}
	// Inside, eth0 has no IPv6 address and a permanent neighbour entry for the gateway at
	// the bridge's MAC: no learned entry counts toward the kernel's one ARP table limit.
	br, err := netlink.LinkByName(p.cfg.Bridge)
	if err != nil {
		t.Fatal(err)
	}
	for _, s := range []*Slot{a, b} {
		checkSlotNeigh(t, s, br.Attrs().HardwareAddr)
	}

	// Listeners inside each sandbox namespace, and on the host (bridge IP, all addresses).
	var inA, inB string
	for _, s := range []struct {
		slot *Slot
		addr *string
	}{{a, &inA}, {b, &inB}} {
		if err := inNetns(t, s.slot.NetnsPath, func() error {
			_, *s.addr = listen(t, net.JoinHostPort(s.slot.IP.String(), "0"))
			return nil
		}); err != nil {
			t.Fatal(err)
		}
	}
	_, onGateway := listen(t, net.JoinHostPort(a.Gateway.String(), "0"))
	_, onAny := listen(t, "0.0.0.0:0")
	_, anyPort, _ := net.SplitHostPort(onAny)

	// The host reaches into both sandboxes (how the node talks to envd), and its own
	// listeners answer: what a sandbox fails to reach below is there to be reached.
	for _, addr := range []string{inA, inB, onGateway, onAny} {
		if err := reach(addr); err != nil {
			t.Errorf("host -> %s: %v", addr, err)
		}
	}
	// A sandbox reaches neither the other sandbox nor any host address.
	hostAddrs := []string{onGateway, net.JoinHostPort(a.Gateway.String(), anyPort)}
	addrs, _ := netlink.AddrList(nil, netlink.FAMILY_V4)
	for _, ad := range addrs {
		if ip := ad.IP.String(); !ad.IP.IsLoopback() && ip != a.Gateway.String() {
			hostAddrs = append(hostAddrs, net.JoinHostPort(ip, anyPort))
		}
	}
	tests := []struct {
		from *Slot
		to   string
	}{{a, inB}, {b, inA}}
	for _, h := range hostAddrs {
		tests = append(tests, struct {
			from *Slot
			to   string
		}{a, h})
	}
	// In parallel: each blocked attempt waits out its whole timeout.
	t.Run("blocked", func(t *testing.T) {
		for _, tc := range tests {
			t.Run(fmt.Sprintf("%s->%s", tc.from.IP, tc.to), func(t *testing.T) {
				t.Parallel()
				err := inNetns(t, tc.from.NetnsPath, func() error { return dialWithin(tc.to, blockedDial) })
				if err == nil {
					t.Fatalf("sandbox %s reached %s", tc.from.IP, tc.to)
				}
			})
		}
	})
	// Inside a sandbox, its own loopback works (the namespace is a working stack).
	if err := inNetns(t, a.NetnsPath, func() error {
		_, addr := listen(t, "127.0.0.1:0")
		return reach(addr)
	}); err != nil {
		t.Fatalf("loopback inside sandbox: %v", err)
	}

	out, err := exec.Command("nft", "list", "set", "inet", p.cfg.Bridge, "blocked").CombinedOutput()
	if err != nil || !strings.Contains(string(out), b.IP.String()) || strings.Contains(string(out), a.IP.String()+",") {
		t.Fatalf("blocked set wrong (%v): %s", err, out)
	}
	for _, s := range []*Slot{a, b} {
		if err := p.Release(ctx, s); err != nil {
			t.Fatal(err)
		}
		if err := p.Release(ctx, s); err != nil {
			t.Fatalf("second release: %v", err)
		}
		if _, err := os.Stat(s.NetnsPath); !errors.Is(err, os.ErrNotExist) {
			t.Fatalf("netns %s left after release", s.Netns)
		}
		if err := p.Settle(ctx); err != nil {
			t.Fatal(err)
		}
		if _, err := netlink.LinkByName(s.HostVeth); err == nil {
			t.Fatalf("veth %s left after release", s.HostVeth)
		}
	}
	out, _ = exec.Command("nft", "list", "set", "inet", p.cfg.Bridge, "blocked").CombinedOutput()
	if strings.Contains(string(out), b.IP.String()) {
		t.Fatalf("released slot still in blocked set: %s", out)
	}
}

// checkSlotNeigh fails t unless s's eth0 has no IPv6 address, its namespace holds a
// permanent neighbour entry for the gateway at mac, its bridge port a static forwarding
// entry for eth0's MAC, and its bridge does no multicast snooping.
func checkSlotNeigh(t *testing.T, s *Slot, mac net.HardwareAddr) {
	t.Helper()
	ns, err := netns.GetFromPath(s.NetnsPath)
	if err != nil {
		t.Fatal(err)
	}
	defer ns.Close()
	h, err := netlink.NewHandleAt(ns)
	if err != nil {
		t.Fatal(err)
	}
	defer h.Close()
	eth, err := h.LinkByName("eth0")
	if err != nil {
		t.Fatal(err)
	}
	if addrs, err := h.AddrList(eth, netlink.FAMILY_V6); err != nil || len(addrs) > 0 {
		t.Errorf("%s: eth0 has IPv6 addresses %v (err %v), want none", s.Netns, addrs, err)
	}
	// The bridge forwards to the sandbox's MAC without learning it: no flood.
	port, err := netlink.LinkByName(s.HostVeth)
	if err != nil {
		t.Fatal(err)
	}
	fdb, err := netlink.NeighList(port.Attrs().Index, unix.AF_BRIDGE)
	if err != nil {
		t.Fatal(err)
	}
	static := false
	for _, n := range fdb {
		if n.HardwareAddr.String() == eth.Attrs().HardwareAddr.String() && n.State == netlink.NUD_NOARP && n.MasterIndex == port.Attrs().MasterIndex {
			static = true
		}
	}
	if !static {
		t.Errorf("%s: no static forwarding entry for eth0's MAC %s in %v", s.HostVeth, eth.Attrs().HardwareAddr, fdb)
	}
	if br, err := netlink.LinkByName(s.Bridge); err != nil {
		t.Fatal(err)
	} else if b, ok := br.(*netlink.Bridge); !ok || b.MulticastSnooping == nil || *b.MulticastSnooping {
		t.Errorf("%s: multicast snooping on", s.Bridge)
	}
	neighs, err := h.NeighList(eth.Attrs().Index, netlink.FAMILY_V4)
	if err != nil {
		t.Fatal(err)
	}
	for _, n := range neighs {
		if n.IP.Equal(s.Gateway.AsSlice()) {
			if n.State != netlink.NUD_PERMANENT || n.HardwareAddr.String() != mac.String() {
				t.Errorf("%s: gateway entry state %#x MAC %s, want permanent at %s", s.Netns, n.State, n.HardwareAddr, mac)
			}
			return
		}
	}
	t.Errorf("%s: no neighbour entry for the gateway %s in %v", s.Netns, s.Gateway, neighs)
}

func TestReconcileSweepsCrashLeftovers(t *testing.T) {
	needRoot(t)
	ctx := context.Background()
	p1 := testPool(t, "ntrec", -1)
	if _, err := p1.Reconcile(ctx, nil); err != nil {
		t.Fatal(err)
	}
	var slots []*Slot
	for range 3 {
		s, err := p1.Acquire(ctx, true)
		if err != nil {
			t.Fatal(err)
		}
		slots = append(slots, s)
	}
	// "Crash": drop p1 without releasing; a new pool finds the slots and keeps two. Its
	// warm pool stays off: it would re-create the freed slots under the checks below.
	cfg := p1.cfg
	cfg.PoolSize = -1
	p2, err := New(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	// Two kept slots without internet: both land in the blocked set (one transaction).
	keepIdx, keep2 := slots[1].Index, slots[2].Index
	kept, err := p2.Reconcile(ctx, map[int]bool{keepIdx: false, keep2: false})
	if err != nil {
		t.Fatal(err)
	}
	if len(kept) != 2 || kept[keepIdx] == nil || kept[keepIdx].AllowInternet || kept[keep2] == nil || kept[keep2].AllowInternet {
		t.Fatalf("kept %v, want %d and %d without internet", kept, keepIdx, keep2)
	}
	for _, s := range slots {
		_, err := os.Stat(s.NetnsPath)
		if exists := err == nil; exists != (s.Index == keepIdx || s.Index == keep2) {
			t.Errorf("slot %d netns exists=%v after reconcile", s.Index, exists)
		}
	}
	out, err := exec.Command("nft", "list", "set", "inet", p2.cfg.Bridge, "blocked").CombinedOutput()
	if err != nil || !strings.Contains(string(out), slots[1].IP.String()) || !strings.Contains(string(out), slots[2].IP.String()) ||
		strings.Contains(string(out), slots[0].IP.String()+",") || strings.Contains(string(out), slots[0].IP.String()+" ") {
		t.Fatalf("blocked set after reconcile (%v), want %s and %s only: %s", err, slots[1].IP, slots[2].IP, out)
	}
	if err := p2.Release(ctx, kept[keep2]); err != nil {
		t.Fatal(err)
	}
	// The next slot handed out must not collide with the kept one.
	s, err := p2.Acquire(ctx, true)
	if err != nil {
		t.Fatal(err)
	}
	if s.Index == keepIdx {
		t.Fatalf("acquired kept index %d", keepIdx)
	}
	if err := p2.Release(ctx, kept[keepIdx]); err != nil {
		t.Fatal(err)
	}
	if err := p2.Release(ctx, s); err != nil {
		t.Fatal(err)
	}
	if err := p2.Close(ctx); err != nil {
		t.Fatal(err)
	}
}

func TestWarmPoolFills(t *testing.T) {
	needRoot(t)
	ctx := context.Background()
	p := testPool(t, "ntwarm", 3)
	if _, err := p.Reconcile(ctx, nil); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(10 * time.Second)
	for {
		p.mu.Lock()
		n := len(p.ready)
		p.mu.Unlock()
		if n == 3 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("warm pool has %d of 3 slots", n)
		}
		time.Sleep(10 * time.Millisecond)
	}
	s, err := p.Acquire(ctx, true)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(s.NetnsPath); err != nil {
		t.Fatalf("warm slot not prepared: %v", err)
	}
	if err := p.Release(ctx, s); err != nil {
		t.Fatal(err)
	}
	if err := p.Close(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := p.Acquire(ctx, true); !errors.Is(err, ErrClosed) {
		t.Fatalf("acquire after close: %v", err)
	}
}

func BenchmarkAcquireRelease(b *testing.B) {
	if os.Geteuid() != 0 {
		b.Skip("needs root")
	}
	ctx := context.Background()
	for _, size := range []int{-1, 4} {
		b.Run(fmt.Sprintf("pool=%d", size), func(b *testing.B) {
			p, err := New(ctx, Config{Bridge: "ntbenchbr", Subnet: "10.89.8.0/24", Prefix: "ntbench", PoolSize: size})
			if err != nil {
				b.Fatal(err)
			}
			defer p.Teardown(ctx)
			p.Reconcile(ctx, nil)
			time.Sleep(200 * time.Millisecond)
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				s, err := p.Acquire(ctx, true)
				if err != nil {
					b.Fatal(err)
				}
				b.StopTimer()
				p.Release(ctx, s)
				time.Sleep(20 * time.Millisecond) // let the warm pool refill, as between creates
				b.StartTimer()
			}
		})
	}
}
