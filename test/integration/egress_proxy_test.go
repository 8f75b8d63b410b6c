package integration

import (
	"context"
	"crypto/tls"
	"fmt"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/aenv-dev/aenv/internal/egressproxy/egresstest"
)

// TestSandboxEgressProxy: a real sandbox whose policy names domains, request transforms
// and a SOCKS5 proxy goes through the node's egress proxy. A namespace made here holds a
// web server (HTTP :80, HTTPS :443, plain TCP :8080), the sandboxes' DNS server and a
// SOCKS5 server on 192.88.99.0/24 (not an infrastructure range, not the host's), and a web server on a private address (10.97.231.2) that a
// name of the DNS server resolves to.
func TestSandboxEgressProxy(t *testing.T) {
	egressProxyFlow(t, "aitegr-remote", "aitegrr0", func(env ...string) *node { return newNode(t, env...) })
}

// egressProxyFlow is TestSandboxEgressProxy on the node mk makes (a backend's node), with
// the test servers' namespace ns joined to the host by veth.
func egressProxyFlow(t *testing.T, ns, veth string, mk func(env ...string) *node) {
	remoteNetns(t, ns, veth)
	run := func(args ...string) { t.Helper(); ipCmd(t, args...) }
	const web, dns, socksIP, private = "192.88.99.80", "192.88.99.53", "192.88.99.90", "10.97.231.2"
	run("addr", "add", "192.88.99.1/24", "dev", veth)
	run("addr", "add", "10.97.231.1/24", "dev", veth)
	for _, a := range []string{web + "/24", dns + "/24", socksIP + "/24", private + "/24"} {
		run("-n", ns, "addr", "add", a, "dev", "eth0")
	}

	echo := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		sni := ""
		if r.TLS != nil {
			sni = " sni=" + r.TLS.ServerName
		}
		fmt.Fprintf(w, "host=%s auth=%s%s\n", r.Host, r.Header.Get("Authorization"), sni)
	})
	for _, addr := range []string{web + ":80", private + ":80"} {
		srv := &httptest.Server{Listener: listenInNetns(t, ns, addr), Config: &http.Server{Handler: echo}}
		srv.Start()
		t.Cleanup(srv.Close)
	}
	// The TLS server records the SNI of each ClientHello (busybox's TLS client omits
	// signature_algorithms, which crypto/tls then refuses: the handshake goes no further).
	var sniMu sync.Mutex
	var snis []string
	sniSeen := func() string {
		sniMu.Lock()
		defer sniMu.Unlock()
		// The names, not the connections: a VM under TCG was seen to make the allowed one twice.
		return fmt.Sprint(slices.Compact(slices.Sorted(slices.Values(snis))))
	}
	tl := tls.NewListener(listenInNetns(t, ns, web+":443"), &tls.Config{GetConfigForClient: func(h *tls.ClientHelloInfo) (*tls.Config, error) {
		sniMu.Lock()
		snis = append(snis, h.ServerName)
		sniMu.Unlock()
		return nil, nil
	}})
	go func() {
		for {
			c, err := tl.Accept()
			if err != nil {
				return
			}
			go func() { _ = c.(*tls.Conn).Handshake(); c.Close() }()
		}
	}()
	plain := listenInNetns(t, ns, web+":8080")
	go func() {
		for {
			c, err := plain.Accept()
			if err != nil {
				return
			}
			c.Write([]byte("hi\n"))
			c.Close()
		}
	}()
	pc := listenPacketInNetns(t, ns, dns+":53")
	go egresstest.ServeDNS(pc, map[string]netip.Addr{
		"api.egress.test": netip.MustParseAddr(web), "www.egress.test": netip.MustParseAddr(web),
		"other.test": netip.MustParseAddr(web), "rebind.egress.test": netip.MustParseAddr(private),
	})
	socks := &egresstest.SOCKS5{User: "su", Password: "sp"}
	go socks.Serve(listenInNetns(t, ns, socksIP+":1080"))

	n := mk("AENV_SANDBOX_SHUTDOWN_ACTION=stop", "AENV_NETWORK_DNS="+dns)
	n.start()
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	c := n.client()
	sb := n.create(ctx, c)
	sh := func(cmd string) string {
		t.Helper()
		res, err := c.Run(ctx, sb, cmd+" 2>&1; true")
		if err != nil {
			t.Fatalf("run %q: %v", cmd, err)
		}
		return strings.TrimSpace(res.Stdout)
	}
	policy := func(body string) {
		t.Helper()
		if out, err := n.api(ctx, "PUT", "/sandboxes/"+sb.ID+"/network", body, 204); err != nil {
			t.Fatalf("PUT network %s: %v %s", body, err, out)
		}
	}
	// busybox wget crashes resolving names (static glibc), so requests are written by hand
	// to the address the name resolves to; the proxy goes by the Host and the SNI.
	get := func(host string) string {
		return fmt.Sprintf(`printf 'GET / HTTP/1.1\r\nHost: %s\r\nConnection: close\r\n\r\n' | nc -w 5 %s 80`, host, web)
	}
	getTLS := func(host string) string {
		return fmt.Sprintf(`exec 3<>/dev/tcp/%s/443 && printf 'GET / HTTP/1.1\r\nHost: %s\r\nConnection: close\r\n\r\n' | busybox ssl_client -s 3 -n %s`, web, host, host)
	}
	policy(`{"allowOut":["*.egress.test"],"denyOut":["0.0.0.0/0"],
		"rules":{"api.egress.test":[{"transform":{"headers":{"Authorization":"Bearer injected"}}}]}}`)
	checks := []struct{ name, cmd, want string }{
		{"nameservers stay reachable", "nslookup api.egress.test", web},
		{"allowed name, transform injected", get("api.egress.test"), "host=api.egress.test auth=Bearer injected"},
		{"wildcard, no rule", get("www.egress.test"), "host=www.egress.test auth=\n"},
		{"name not allowed", get("other.test"), "403 Forbidden"},
		{"name rebinding to a private range", get("rebind.egress.test"), "infrastructure range"},
		{"other ports keep the address rules", "nc -w 2 " + web + " 8080 </dev/null || echo none", "none"},
	}
	for _, ck := range checks {
		if got := sh(ck.cmd); !strings.Contains(got+"\n", ck.want) {
			t.Errorf("%s: %q gave %q, want %q", ck.name, ck.cmd, got, ck.want)
		}
	}

	sh(getTLS("www.egress.test"))
	sh(getTLS("other.test"))
	if got := sniSeen(); got != "[www.egress.test]" {
		t.Errorf("the TLS server saw SNIs %s, want only the allowed one", got)
	}

	policy(`{"allowOut":["api.egress.test"],"egressProxy":{"address":"` + socksIP + `:1080","username":"su","password":"sp"}}`)
	if got := sh(get("api.egress.test")); !strings.Contains(got, "host=api.egress.test") {
		t.Errorf("through SOCKS5: %q", got)
	}
	if got := sh("nc -w 2 " + web + " 8080 </dev/null"); got != "hi" {
		t.Errorf("any port through SOCKS5: %q", got)
	}
	if got := fmt.Sprint(socks.Targets()); !strings.Contains(got, web+":80") || !strings.Contains(got, web+":8080") {
		t.Errorf("the SOCKS5 server was asked for %s", got)
	}
	detail, err := n.api(ctx, "GET", "/sandboxes/"+sb.ID, "", 200)
	if err != nil || strings.Contains(string(detail), `"sp"`) || !strings.Contains(string(detail), socksIP+":1080") {
		t.Errorf("detail %s, %v (the proxy without its password)", detail, err)
	}

	// Back to no proxy: the redirect is gone and the address rules decide again.
	policy(`{"denyOut":["` + web + `/32"]}`)
	if got := sh(get("api.egress.test")); strings.Contains(got, "host=") {
		t.Errorf("denyOut after the proxy: %q", got)
	}
	out := n.output()
	for _, bad := range []string{"level=ERROR", "level=WARN", "sp\""} {
		if strings.Contains(out, bad) {
			t.Errorf("the node logged %s:\n%s", bad, out)
		}
	}
}
