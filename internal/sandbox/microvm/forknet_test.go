package microvm

import (
	"context"
	"errors"
	"fmt"
	"io"
	mrand "math/rand/v2"
	"net"
	"os"
	"strconv"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/aenv-dev/aenv/internal/sandbox"
)

// TestForkChildLeavesParentConnections: a fork child's memory holds copies of the
// parent's TCP connections, but nothing it does with them may reach the parent's peers.
// Here the parent runs an echo server with one client on the host; the child ends its
// copy of the server, so the child's kernel closes its copy of the connection (a FIN
// with the parent's addresses and sequence numbers). The host's connection to the
// parent must see none of it and keep echoing.
func TestForkChildLeavesParentConnections(t *testing.T) {
	b := newTestBackend(t)
	src := launch(t, b, "sbx-cnsrc", sandbox.Resources{CPUCount: 1, MemoryMB: testMemMB, DiskSizeMB: templateMB})
	// nc -e execs cat on the accepted connection in its own process: the pid stays.
	mustSh(t, src, `setsid sh -c 'echo $$ > /tmp/echo.pid; exec nc -l -p 7000 -e /bin/cat' </dev/null >/dev/null 2>&1 &`)
	conn := dialServer(t, &net.Dialer{}, src)
	echo := func(when string) {
		t.Helper()
		msg := []byte("ping " + when + "\n")
		if err := conn.SetDeadline(time.Now().Add(5 * time.Second)); err != nil {
			t.Fatal(err)
		}
		if _, err := conn.Write(msg); err != nil {
			t.Fatalf("%s: write to the parent: %v", when, err)
		}
		got := make([]byte, len(msg))
		if _, err := io.ReadFull(conn, got); err != nil {
			t.Fatalf("%s: echo from the parent: %v", when, err)
		}
	}
	echo("before the fork")

	child := forkOne(t, src, "sbx-cnfork")
	mustSh(t, child, `kill "$(cat /tmp/echo.pid)"`)
	// The child's copy ends in the child at once (the namespace resets it) instead of
	// retransmitting its FIN into nothing: no socket of port 7000 (1B58) is left there
	// but a listening one (nc listens on IPv6, v4 clients mapped).
	const copies = `awk '$2 ~ /:1B58$/ && $4 != "0A"' /proc/net/tcp /proc/net/tcp6`
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(100 * time.Millisecond) {
		left := mustSh(t, child, copies)
		if left == "" {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the child's copy of the connection is still there 10 s after its process ended:\n%s", left)
		}
	}

	// The host's connection sees no end of stream from the child's close...
	if err := conn.SetReadDeadline(time.Now().Add(2 * time.Second)); err != nil {
		t.Fatal(err)
	}
	if n, err := conn.Read(make([]byte, 64)); !errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("the parent's connection after the child closed its copy: read %d bytes, err %v; "+
			"want nothing (the child's FIN reached the parent's peer)", n, err)
	}
	// ...and the parent still serves it.
	echo("after the child closed its copy")
}

// TestForkChildTakesTheParentsClientPort: a client of the parent connects to the fork
// child from the same host port. The child's copy of the parent's connection has been
// sending meanwhile; its packets must not have made the child's namespace take that port
// for a connection of its own, or the new connection misses the translation to the
// guest and the namespace itself refuses it.
func TestForkChildTakesTheParentsClientPort(t *testing.T) {
	b := newTestBackend(t)
	src := launch(t, b, "sbx-cpsrc", sandbox.Resources{CPUCount: 1, MemoryMB: testMemMB, DiskSizeMB: templateMB})
	// Each client gets a line every 0.2 s, in the parent and in the child.
	mustSh(t, src, `setsid nc -ll -p 7000 -e sh -c 'while sleep 0.2; do echo tick || exit; done' </dev/null >/dev/null 2>&1 &`)
	// Both connections bind the same host port, one below the kernel's ephemeral range:
	// one of that range, taken by the first connection, can be taken meanwhile by another
	// program's connection to elsewhere, without SO_REUSEADDR, and the second bind then
	// fails (a CI run, other packages' tests beside this one).
	d := net.Dialer{LocalAddr: &net.TCPAddr{Port: unusedLowPort(t)}, Control: func(_, _ string, c syscall.RawConn) error {
		var serr error
		err := c.Control(func(fd uintptr) {
			for _, o := range []int{unix.SO_REUSEADDR, unix.SO_REUSEPORT} {
				if serr == nil {
					serr = unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, o, 1)
				}
			}
		})
		return errors.Join(err, serr)
	}}
	tick := func(c net.Conn, what string) {
		t.Helper()
		if err := c.SetReadDeadline(time.Now().Add(5 * time.Second)); err != nil {
			t.Fatal(err)
		}
		if _, err := io.ReadFull(c, make([]byte, len("tick\n"))); err != nil {
			t.Fatalf("%s: %v", what, err)
		}
	}
	conn := dialServer(t, &d, src)
	tick(conn, "parent")

	child := forkOne(t, src, "sbx-cpfork")
	time.Sleep(time.Second) // the child's copy sends its ticks
	cc, err := d.Dial("tcp", net.JoinHostPort(child.Endpoint().Host, "7000"))
	if err != nil {
		t.Fatalf("connect to the child from %v, the port of the parent's client: %v", d.LocalAddr, err)
	}
	defer cc.Close()
	tick(cc, "child")
	tick(conn, "parent after the fork")
}

// dialServer connects with d to port 7000 of inst once a server there listens.
func dialServer(t *testing.T, d *net.Dialer, inst *Instance) net.Conn {
	t.Helper()
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(50 * time.Millisecond) {
		c, err := d.Dial("tcp", net.JoinHostPort(inst.Endpoint().Host, "7000"))
		if err == nil {
			t.Cleanup(func() { c.Close() })
			return c
		}
		if time.Now().After(deadline) {
			t.Fatalf("server in %s: %v", inst.id, err)
		}
	}
}

// forkOne forks src into one child, id, and waits for its envd.
func forkOne(t *testing.T, src *Instance, id string) *Instance {
	t.Helper()
	res, err := src.Fork(context.Background(), []sandbox.ForkSpec{{SandboxID: id}})
	if err != nil {
		t.Fatal(err)
	}
	if res[0].Err != nil {
		t.Fatal(res[0].Err)
	}
	child := res[0].Instance.(*Instance)
	waitEnvdErr(t, child)
	return child
}

// unusedLowPort is a TCP port below the kernel's ephemeral range that nothing listens on
// now: connections that do not bind get ports of that range only.
func unusedLowPort(t *testing.T) int {
	t.Helper()
	raw, err := os.ReadFile("/proc/sys/net/ipv4/ip_local_port_range")
	if err != nil {
		t.Fatal(err)
	}
	var low int
	if _, err := fmt.Sscan(string(raw), &low); err != nil || low < 2048 {
		t.Fatalf("ephemeral port range %q: %v", raw, err)
	}
	for range 100 {
		port := 1024 + mrand.IntN(low-1024)
		if l, err := net.Listen("tcp", net.JoinHostPort("", strconv.Itoa(port))); err == nil {
			l.Close()
			return port
		}
	}
	t.Fatalf("no unused port below %d", low)
	return 0
}
