package integration

import (
	"fmt"
	"net"
	"os/exec"
	"runtime"
	"testing"

	"github.com/vishvananda/netns"
)

// ipCmd runs ip(8) with args and fails the test with its output when it fails.
func ipCmd(t *testing.T, args ...string) {
	t.Helper()
	if out, err := exec.Command("ip", args...).CombinedOutput(); err != nil {
		t.Fatalf("ip %v: %v: %s", args, err, out)
	}
}

// remoteNetns makes a network namespace ns reached from the host through veth (the
// namespace's end is its eth0), both up, and removes them when the test ends. It stands for
// the world outside the host: the tests give it addresses and listeners of their own, so no
// test ever depends on a real outside address. A leftover pair from a killed run is removed
// first.
func remoteNetns(t *testing.T, ns, veth string) {
	t.Helper()
	cleanup := func() {
		_ = exec.Command("ip", "link", "del", veth).Run()
		_ = exec.Command("ip", "netns", "del", ns).Run()
	}
	cleanup()
	t.Cleanup(cleanup)
	ipCmd(t, "netns", "add", ns)
	ipCmd(t, "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
	ipCmd(t, "link", "set", veth, "up")
	ipCmd(t, "-n", ns, "link", "set", "eth0", "up")
	ipCmd(t, "-n", ns, "link", "set", "lo", "up")
}

// inNetns runs fn on a thread inside the named namespace. Sockets fn opens stay in that
// namespace, and serve from any goroutine.
func inNetns(t testing.TB, name string, fn func() error) {
	t.Helper()
	if err := runInNetns(name, fn); err != nil {
		t.Fatal(err)
	}
}

// runInNetns is inNetns returning the error instead of failing the test. Processes fn
// starts are forked from the switched thread, so they run in the namespace too.
func runInNetns(name string, fn func() error) error {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	orig, err := netns.Get()
	if err != nil {
		return err
	}
	defer orig.Close()
	h, err := netns.GetFromName(name)
	if err != nil {
		return fmt.Errorf("netns %s: %w", name, err)
	}
	defer h.Close()
	if err := netns.Set(h); err != nil {
		return fmt.Errorf("enter netns %s: %w", name, err)
	}
	ferr := fn()
	if err := netns.Set(orig); err != nil {
		panic(err) // this thread must not run anything else in the wrong namespace
	}
	return ferr
}

// listenInNetns listens on addr (TCP) inside the named namespace, until the test ends.
func listenInNetns(t *testing.T, name, addr string) net.Listener {
	t.Helper()
	var l net.Listener
	inNetns(t, name, func() (err error) { l, err = net.Listen("tcp", addr); return err })
	t.Cleanup(func() { l.Close() })
	return l
}

// listenPacketInNetns is listenInNetns for UDP.
func listenPacketInNetns(t *testing.T, name, addr string) net.PacketConn {
	t.Helper()
	var pc net.PacketConn
	inNetns(t, name, func() (err error) { pc, err = net.ListenPacket("udp4", addr); return err })
	t.Cleanup(func() { pc.Close() })
	return pc
}
