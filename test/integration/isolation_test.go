package integration

import (
	"context"
	"fmt"
	"net"
	"net/netip"
	"strings"
	"testing"
	"time"

	"github.com/aenv-dev/aenv/internal/bench"
)

// envdPort is where envd listens in every sandbox.
const envdPort = 49983

// TestIsolation creates two sandboxes through the API and checks from inside them, with
// busybox tools run through envd, that neither sees the other's files or processes nor
// reaches the other's address, and that neither reaches the node's API port on any host
// address. Each negative check has a positive control, so a broken tool or a typo cannot
// pass for isolation.
func TestIsolation(t *testing.T) {
	n := newNode(t, "AENV_SANDBOX_SHUTDOWN_ACTION=stop")
	n.start()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	c := n.client()
	a, b := n.create(ctx, c), n.create(ctx, c)
	ipA, gw := sandboxAddr(ctx, t, c, a)
	ipB, _ := sandboxAddr(ctx, t, c, b)
	if ipA == ipB {
		t.Fatalf("both sandboxes have address %s", ipA)
	}
	_, apiPort, _ := net.SplitHostPort(n.addr)

	// A canary on the bridge (the host as sandboxes see it) at the API's port: were the
	// host's input filter missing, a sandbox would reach it.
	canary, err := net.Listen("tcp", net.JoinHostPort(gw.String(), apiPort))
	if err != nil {
		t.Fatalf("canary listener on the bridge address: %v", err)
	}
	defer canary.Close()
	go func() {
		for {
			conn, err := canary.Accept()
			if err != nil {
				return
			}
			conn.Close()
		}
	}()
	if conn, err := net.DialTimeout("tcp", canary.Addr().String(), time.Second); err != nil {
		t.Fatalf("positive control: the host cannot reach its own canary: %v", err)
	} else {
		conn.Close()
	}

	secret := "secret-" + randHex(8)
	run(ctx, t, c, a, fmt.Sprintf("echo %s > /tmp/%[1]s && echo %[1]s > $HOME/%[1]s && (sleep 1234 >/dev/null 2>&1 &)", secret))

	t.Run("files", func(t *testing.T) {
		if out := run(ctx, t, c, a, "cat /tmp/"+secret); out != secret {
			t.Fatalf("positive control: A cannot read its own file: %q", out)
		}
		out := run(ctx, t, c, b, fmt.Sprintf("ls -a /tmp $HOME; find / -xdev -name '%s*' 2>/dev/null; true", secret))
		if strings.Contains(out, secret) {
			t.Errorf("B sees A's files:\n%s", out)
		}
	})
	t.Run("processes", func(t *testing.T) {
		if out := run(ctx, t, c, a, "ps -o args"); !strings.Contains(out, "sleep 1234") {
			t.Fatalf("positive control: A does not see its own sleep:\n%s", out)
		}
		if out := run(ctx, t, c, b, "ps -o args"); strings.Contains(out, "sleep 1234") {
			t.Errorf("B sees A's processes:\n%s", out)
		}
	})
	t.Run("network between sandboxes", func(t *testing.T) {
		if !reach(ctx, t, c, a, ipA, envdPort) {
			t.Fatalf("positive control: A cannot reach its own envd at %s:%d", ipA, envdPort)
		}
		if conn, err := net.DialTimeout("tcp", netip.AddrPortFrom(ipB, envdPort).String(), time.Second); err != nil {
			t.Fatalf("positive control: the host cannot reach B's envd: %v", err)
		} else {
			conn.Close()
		}
		if reach(ctx, t, c, a, ipB, envdPort) {
			t.Errorf("A reaches B's envd at %s:%d", ipB, envdPort)
		}
		if reach(ctx, t, c, b, ipA, envdPort) {
			t.Errorf("B reaches A's envd at %s:%d", ipA, envdPort)
		}
	})
	t.Run("node API on host addresses", func(t *testing.T) {
		addrs := hostAddrs(t)
		addrs = append(addrs, gw)
		for _, ip := range addrs {
			if reach(ctx, t, c, a, ip, mustAtoi(t, apiPort)) {
				t.Errorf("A reaches port %s on host address %s", apiPort, ip)
			}
		}
	})
}

// sandboxAddr returns a sandbox's eth0 address and its default gateway (the bridge).
func sandboxAddr(ctx context.Context, t *testing.T, c *bench.Client, sb bench.Sandbox) (ip, gw netip.Addr) {
	t.Helper()
	out := run(ctx, t, c, sb, `ip -4 -o addr show eth0 | awk '{print $4}' | cut -d/ -f1; ip route | awk '/^default/ {print $3}'`)
	f := strings.Fields(out)
	if len(f) != 2 {
		t.Fatalf("sandbox %s: address and gateway: %q", sb.ID, out)
	}
	var err error
	if ip, err = netip.ParseAddr(f[0]); err != nil {
		t.Fatal(err)
	}
	if gw, err = netip.ParseAddr(f[1]); err != nil {
		t.Fatal(err)
	}
	return ip, gw
}

// reach reports whether a TCP connection from inside sb to ip:port succeeds (busybox nc,
// 1 s connect timeout; stdin at EOF so a connected nc ends at once). The verdict is nc's exit
// code; a failure of the command stream itself is retried (an envd stream through the proxy
// is, rarely, cut short; see the report on issue 3), which cannot turn a connection into none.
func reach(ctx context.Context, t *testing.T, c *bench.Client, sb bench.Sandbox, ip netip.Addr, port int) bool {
	t.Helper()
	cmd := fmt.Sprintf("timeout 5 nc -w 1 %s %d </dev/null >/dev/null 2>&1", ip, port)
	var err error
	for range 3 {
		var res bench.CommandResult
		if res, err = c.Run(ctx, sb, cmd); err == nil {
			return res.ExitCode == 0
		}
		t.Logf("nc in %s: %v (retrying)", sb.ID, err)
	}
	t.Fatalf("nc in %s: %v", sb.ID, err)
	return false
}

// hostAddrs lists the host's IPv4 addresses (loopback included: inside a sandbox it is
// the sandbox's own, which must not lead to the node either).
func hostAddrs(t *testing.T) []netip.Addr {
	t.Helper()
	ifs, err := net.InterfaceAddrs()
	if err != nil {
		t.Fatal(err)
	}
	var out []netip.Addr
	for _, a := range ifs {
		if p, err := netip.ParsePrefix(a.String()); err == nil && p.Addr().Is4() {
			out = append(out, p.Addr())
		}
	}
	return out
}

func mustAtoi(t *testing.T, s string) int {
	t.Helper()
	var v int
	if _, err := fmt.Sscan(s, &v); err != nil {
		t.Fatal(err)
	}
	return v
}
