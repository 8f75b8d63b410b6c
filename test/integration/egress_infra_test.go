package integration

import (
	"context"
	"fmt"
	"net"
	"strings"
	"testing"
	"time"
)

// TestSandboxInfraEgress: a real sandbox of a node with one allowed range reaches a
// "public" listener and the allowed one, and gets no answer from link-local (cloud
// metadata), a private range or CGNAT listeners, even when its allowOut names them. The
// targets live in a namespace behind a host veth made here; the node logs nothing about
// the dropped probes.
func TestSandboxInfraEgress(t *testing.T) {
	ns, veth := "aitinf-remote", "aitinfr0"
	remoteNetns(t, ns, veth)
	run := func(args ...string) { t.Helper(); ipCmd(t, args...) }
	targets := map[string]string{ // name → address in the namespace
		"public": "203.0.113.7", "allowed": "10.97.222.2", "metadata": "169.254.79.254",
		"private": "10.97.221.2", "cgnat": "100.64.221.2",
	}
	for _, ip := range targets {
		parts := strings.Split(ip, ".")
		run("addr", "add", strings.Join(parts[:3], ".")+".1/24", "dev", veth)
		run("-n", ns, "addr", "add", ip+"/24", "dev", "eth0")
	}
	// One listener per address, answering "hi".
	for _, ip := range targets {
		l := listenInNetns(t, ns, net.JoinHostPort(ip, "8080"))
		go func() {
			for {
				c, err := l.Accept()
				if err != nil {
					return
				}
				c.Write([]byte("hi\n"))
				c.Close()
			}
		}()
	}
	for name, ip := range targets {
		var err error
		for deadline := time.Now().Add(5 * time.Second); time.Now().Before(deadline); time.Sleep(100 * time.Millisecond) {
			var c net.Conn
			if c, err = net.DialTimeout("tcp", net.JoinHostPort(ip, "8080"), time.Second); err == nil {
				c.Close()
				break
			}
		}
		if err != nil {
			t.Fatalf("control: the host cannot reach the %s listener %s: %v", name, ip, err)
		}
	}

	n := newNode(t, "AENV_SANDBOX_SHUTDOWN_ACTION=stop", "AENV_NETWORK_ALLOW_RANGES=10.97.222.0/24")
	n.start()
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	c := n.client()
	sb := n.create(ctx, c)
	probe := func(ip string) bool {
		res, err := c.Run(ctx, sb, fmt.Sprintf("nc -w 2 %s 8080 </dev/null", ip))
		if err != nil {
			t.Fatalf("probe %s: %v", ip, err)
		}
		return strings.Contains(res.Stdout, "hi")
	}
	check := func(when string) {
		for name, ip := range targets {
			want := name == "public" || name == "allowed"
			if got := probe(ip); got != want {
				t.Errorf("%s: sandbox reached %s (%s) = %v, want %v", when, name, ip, got, want)
			}
		}
	}
	check("defaults")
	if _, err := n.api(ctx, "PUT", "/sandboxes/"+sb.ID+"/network",
		`{"allowOut":["169.254.79.254","10.97.221.0/24","100.64.0.0/10"]}`, 204); err != nil {
		t.Fatal(err)
	}
	check("allowOut naming the denied ranges")
	out := n.output()
	for _, bad := range []string{"level=ERROR", "level=WARN"} {
		if strings.Contains(out, bad) {
			t.Errorf("the node logged %s:\n%s", bad, out)
		}
	}
}
