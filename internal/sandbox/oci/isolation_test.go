package oci

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/aenv-dev/aenv/internal/sandbox"
	"github.com/vishvananda/netlink"
)

// httpGet is a shell command that fetches path over plain TCP with busybox nc (Debian's
// static busybox wget crashes) and fails when it cannot connect within 2 s.
func httpGet(ip string, port int, path string) string {
	return fmt.Sprintf(`printf 'GET %s HTTP/1.0\r\n\r\n' | nc -w 2 %s %d`, path, ip, port)
}

func TestIsolation(t *testing.T) {
	for _, mode := range []string{UserNSAuto, UserNSOff} {
		t.Run("userns="+mode, func(t *testing.T) { testIsolation(t, mode) })
	}
}

func testIsolation(t *testing.T, mode string) {
	e := newTestBackend(t, func(c *Config) { c.UserNamespace = mode })
	a := e.launch(t, "iso-a", sandbox.Resources{CPUCount: 1, MemoryMB: 128})
	b := e.launch(t, "iso-b", sandbox.Resources{CPUCount: 1, MemoryMB: 128})
	aIP, bIP := a.Endpoint().Host, b.Endpoint().Host

	t.Run("files", func(t *testing.T) {
		if out, code := e.sh(t, a, "echo secret > /root/a.txt && echo x > /etc/a-etc && echo ok"); code != 0 {
			t.Fatalf("write in a: %d %s", code, out)
		}
		if out, code := e.sh(t, b, "cat /root/a.txt /etc/a-etc"); code == 0 {
			t.Fatalf("b sees a's files: %s", out)
		}
		if _, err := os.Stat(filepath.Join(e.template, "etc/a-etc")); !os.IsNotExist(err) {
			t.Fatalf("write reached the template: %v", err)
		}
		if _, err := os.Stat(filepath.Join(a.l.upper(), "etc/a-etc")); err != nil {
			t.Fatalf("write not in a's upper: %v", err)
		}
	})

	t.Run("processes", func(t *testing.T) {
		e.sh(t, a, "sleep 4242 >/dev/null 2>&1 &")
		// The shell returns once it forked the sleep; on a loaded host the child may not
		// have exec'd yet (ps then lists it as a second /bin/sh).
		var out string
		for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(50 * time.Millisecond) {
			if out, _ = e.sh(t, a, "ps -o args"); strings.Contains(out, "sleep 4242") {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("control: a does not see its own sleep: %s", out)
			}
		}
		out, _ = e.sh(t, b, "ps -o args; ls -d /proc/[0-9]*")
		if strings.Contains(out, "4242") {
			t.Fatalf("b sees a's processes: %s", out)
		}
		if pid := a.InitPID(context.Background()); pid == 0 || strings.Contains(out, fmt.Sprintf("/proc/%d\n", pid)) {
			t.Fatalf("a's init pid %d visible in b or unknown: %s", pid, out)
		}
	})

	t.Run("network between sandboxes", func(t *testing.T) {
		if out, code := e.sh(t, a, httpGet(aIP, 49983, "/health")); code != 0 || !strings.Contains(out, "200 OK") {
			t.Fatalf("control: a cannot reach itself: %s", out)
		}
		for _, tc := range []struct {
			from *Instance
			to   string
		}{{b, aIP}, {a, bIP}} {
			if out, code := e.sh(t, tc.from, httpGet(tc.to, 49983, "/health")); code == 0 || strings.Contains(out, "200 OK") {
				t.Errorf("%s reached %s: %s", tc.from.id, tc.to, out)
			}
		}
	})

	t.Run("host services", func(t *testing.T) {
		l, err := net.Listen("tcp", "0.0.0.0:0")
		if err != nil {
			t.Fatal(err)
		}
		srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { w.Write([]byte("host-service-reply")) })}
		go srv.Serve(l)
		t.Cleanup(func() { srv.Close() })
		port := l.Addr().(*net.TCPAddr).Port
		gw := e.b.Pool().Gateway().String()
		targets := []string{gw, "127.0.0.1"}
		addrs, _ := netlink.AddrList(nil, netlink.FAMILY_V4)
		for _, ad := range addrs {
			if s := ad.IP.String(); s != gw && !ad.IP.IsLoopback() {
				targets = append(targets, s)
			}
		}
		c := http.Client{Timeout: 2 * time.Second}
		resp, err := c.Get(fmt.Sprintf("http://%s:%d/", gw, port))
		if err != nil {
			t.Fatalf("control: host cannot reach its own listener on %s: %v", gw, err)
		}
		resp.Body.Close()
		for _, ip := range targets {
			if out, code := e.sh(t, a, httpGet(ip, port, "/")); code == 0 || strings.Contains(out, "host-service-reply") {
				t.Errorf("sandbox reached host service %s:%d: %s", ip, port, out)
			}
		}
	})

	t.Run("hardening", func(t *testing.T) {
		tests := []struct {
			name, script string
			wantOK       bool
		}{
			{"mount refused", "mount -t tmpfs t /mnt", false},
			{"unshare refused", "unshare -m true", false},
			{"nested userns refused", "unshare -U -r true", false},
			{"kcore masked", "test -s /proc/kcore", false},
			{"proc sys read-only", "echo 1 > /proc/sys/kernel/panic", false},
			// Unset, so sudo works (spec.go); the capability set below bounds what it reaches.
			{"setuid allowed", "grep -q '^NoNewPrivs:[[:space:]]*0' /proc/self/status", true},
			// Docker's default set minus NET_RAW and MKNOD: no SYS_ADMIN, NET_ADMIN, SYS_PTRACE...
			{"capability set", "grep -q '^CapEff:[[:space:]]*00000000a00405fb$' /proc/self/status", true},
			{"ifconfig change refused", "ip addr add 10.89.16.200/24 dev eth0", false},
			{"bind low port", "nc -l -p 80 & p=$!; sleep 0.2; kill $p", true},
			// The host's OOM killer takes a sandbox's processes before the data plane, and
			// nothing inside can put itself below the host's processes (spec.go).
			{"OOM score raised", "grep -qx 500 /proc/self/oom_score_adj", true},
			{"OOM score not below the host's", "echo -1 > /proc/self/oom_score_adj", false},
			{"pids limit visible", "grep -qx 256 /sys/fs/cgroup/pids/pids.max 2>/dev/null || grep -qx 256 /sys/fs/cgroup/pids.max", true},
		}
		for _, tc := range tests {
			t.Run(tc.name, func(t *testing.T) {
				out, code := e.sh(t, a, tc.script)
				if (code == 0) != tc.wantOK {
					t.Fatalf("exit %d, want ok=%v: %s", code, tc.wantOK, out)
				}
			})
		}
	})

	t.Run("user namespace", func(t *testing.T) {
		if !e.b.UserNamespaces() {
			t.Skip("backend runs without user namespaces on this host")
		}
		out, _ := e.sh(t, a, "cat /proc/self/uid_map")
		f := strings.Fields(out)
		if len(f) != 3 || f[0] != "0" || f[1] == "0" || f[2] != "65536" {
			t.Fatalf("uid_map %q: sandbox root is not an unprivileged host range", out)
		}
		outB, _ := e.sh(t, b, "cat /proc/self/uid_map")
		if strings.Fields(outB)[1] == f[1] {
			t.Fatalf("a and b share a host uid range: %q %q", out, outB)
		}
	})
}
