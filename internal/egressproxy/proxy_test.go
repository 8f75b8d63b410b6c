package egressproxy

import (
	"bufio"
	"context"
	"crypto/tls"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/aenv-dev/aenv/internal/egressproxy/egresstest"
	"github.com/aenv-dev/aenv/internal/sandbox"
)

// world is a set of servers on loopback addresses (127.77.x.y, so ports 80 and 443 are
// free to take), a DNS server naming them and a proxy whose "original destination" is
// what each test connection declares.
type world struct {
	t     testing.TB
	proxy *Proxy
	addr  string
	dsts  sync.Map // client local address → netip.AddrPort
}

const (
	webIP    = "127.77.1.2" // api.example.test, www.example.test, other.test: HTTP :80, TLS :443
	rawIP    = "127.77.1.3" // :8080 answers "raw"
	rebindIP = "127.77.9.2" // rebind.example.test, inside the denied range
	httpsIP  = "127.77.1.4" // secure, wrong and plain.example.test: HTTPS :443 (tls_test.go)
	dnsIP    = "127.77.0.53"
)

func listen(t testing.TB, addr string) net.Listener {
	t.Helper()
	l, err := net.Listen("tcp4", addr)
	if err != nil {
		if os.Geteuid() != 0 {
			t.Skipf("needs root to listen on %s: %v", addr, err)
		}
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	return l
}

func newWorld(t testing.TB, opts ...func(*Config)) *world {
	t.Helper()
	echo := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		fmt.Fprintf(w, "host=%s auth=%s x=%s", r.Host, r.Header.Get("Authorization"), r.Header.Get("X-Extra"))
	})
	for _, ip := range []string{webIP, rebindIP} {
		srv := &httptest.Server{Listener: listen(t, ip+":80"), Config: &http.Server{Handler: echo}}
		srv.Start()
		t.Cleanup(srv.Close)
	}
	tl := srvTLS(t, listen(t, webIP+":443"))
	_ = tl
	raw := listen(t, rawIP+":8080")
	go func() {
		for {
			c, err := raw.Accept()
			if err != nil {
				return
			}
			io.WriteString(c, "raw\n")
			c.Close()
		}
	}()
	pc, err := net.ListenPacket("udp4", dnsIP+":53")
	if err != nil {
		t.Skipf("DNS listener: %v", err)
	}
	t.Cleanup(func() { pc.Close() })
	go egresstest.ServeDNS(pc, map[string]netip.Addr{
		"api.example.test": netip.MustParseAddr(webIP), "www.example.test": netip.MustParseAddr(webIP),
		"other.test": netip.MustParseAddr(webIP), "rebind.example.test": netip.MustParseAddr(rebindIP),
		"secure.example.test": netip.MustParseAddr(httpsIP), "wrong.example.test": netip.MustParseAddr(httpsIP),
		"plain.example.test": netip.MustParseAddr(httpsIP),
	})
	w := &world{t: t}
	cfg := Config{
		Deny:     []netip.Prefix{netip.MustParsePrefix("127.77.9.0/24")},
		HostAddr: func(netip.Addr) bool { return false },
		Resolver: &net.Resolver{PreferGo: true, Dial: func(ctx context.Context, network, _ string) (net.Conn, error) {
			var d net.Dialer
			return d.DialContext(ctx, network, dnsIP+":53")
		}},
		OriginalDst: w.originalDst,
	}
	for _, o := range opts {
		o(&cfg)
	}
	w.proxy = New(cfg)
	pl := listen(t, "127.0.0.1:0")
	w.addr = pl.Addr().String()
	go w.proxy.Serve(pl)
	t.Cleanup(w.proxy.Close)
	return w
}

// srvTLS answers every TLS connection with "tls <SNI>".
func srvTLS(t testing.TB, l net.Listener) net.Listener {
	cert := httptest.NewUnstartedServer(nil)
	cert.StartTLS()
	certs := cert.TLS.Certificates
	cert.Close()
	tl := tls.NewListener(l, &tls.Config{Certificates: certs})
	go func() {
		for {
			c, err := tl.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				tc := c.(*tls.Conn)
				if tc.Handshake() != nil {
					return
				}
				io.WriteString(c, "tls "+tc.ConnectionState().ServerName+"\n")
			}()
		}
	}()
	return tl
}

func (w *world) originalDst(c net.Conn) (netip.AddrPort, error) {
	for range 20000 {
		if d, ok := w.dsts.Load(c.RemoteAddr().String()); ok {
			return d.(netip.AddrPort), nil
		}
		time.Sleep(50 * time.Microsecond)
	}
	return netip.AddrPort{}, fmt.Errorf("no destination for %s", c.RemoteAddr())
}

// dial connects to the proxy as a sandbox connection headed for dst.
func (w *world) dial(dst string) net.Conn {
	w.t.Helper()
	c, err := net.Dial("tcp4", w.addr)
	if err != nil {
		w.t.Fatal(err)
	}
	w.t.Cleanup(func() { c.Close() })
	w.dsts.Store(c.LocalAddr().String(), netip.MustParseAddrPort(dst))
	_ = c.SetDeadline(time.Now().Add(10 * time.Second))
	return c
}

// get sends one HTTP request for host to dst and returns the status and body ("" and
// the error when the connection ends without an answer).
func (w *world) get(dst, host string) (int, string) {
	c := w.dial(dst)
	fmt.Fprintf(c, "GET / HTTP/1.1\r\nHost: %s\r\nAuthorization: from-sandbox\r\nConnection: close\r\n\r\n", host)
	resp, err := http.ReadResponse(bufio.NewReader(c), nil)
	if err != nil {
		return 0, err.Error()
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

func (w *world) tls(dst, sni string) string {
	c := tls.Client(w.dial(dst), &tls.Config{ServerName: sni, InsecureSkipVerify: true})
	if err := c.Handshake(); err != nil {
		return "error: " + err.Error()
	}
	b, err := io.ReadAll(c)
	if err != nil && len(b) == 0 {
		return "error: " + err.Error()
	}
	return strings.TrimSpace(string(b))
}

func TestProxyPolicies(t *testing.T) {
	w := newWorld(t)
	src := netip.MustParseAddr("127.0.0.1")
	allowOnly := sandbox.Egress{
		AllowInternet: true,
		DenyOut:       []netip.Prefix{netip.MustParsePrefix("0.0.0.0/0")},
		AllowOut:      []netip.Prefix{netip.MustParsePrefix(rawIP + "/32")},
		AllowDomains:  []string{"*.example.test"},
		Rules: map[string][]sandbox.Transform{
			"api.example.test": {{Headers: map[string]string{"Authorization": "Bearer injected"}}, {Headers: map[string]string{"X-Extra": "2"}}},
			"*.example.test":   {{Headers: map[string]string{"X-Extra": "wild"}}},
			"other.test":       {{Headers: map[string]string{"Authorization": "Bearer other"}}},
		},
	}
	w.proxy.Set(src, allowOnly)
	tests := []struct {
		name, dst, host string
		status          int
		body            string
	}{
		{"exact rule replaces the header", webIP + ":80", "API.example.test", 200, "host=API.example.test auth=Bearer injected x=2"},
		{"longest wildcard rule", webIP + ":80", "www.example.test", 200, "host=www.example.test auth=from-sandbox x=wild"},
		// The sandbox's chosen address is not used for a name: the proxy dials what the
		// name resolves to.
		{"name resolved by the proxy", rawIP + ":80", "www.example.test:80", 200, "host=www.example.test:80 auth=from-sandbox x=wild"},
		{"apex is not matched by the wildcard", webIP + ":80", "example.test", 403, "denied"},
		{"rules alone do not allow", webIP + ":80", "other.test", 403, "denied"},
		{"rebinding into a denied range", webIP + ":80", "rebind.example.test", 403, "infrastructure range"},
		{"unresolvable name", webIP + ":80", "nx.example.test", 403, "resolve"},
		{"IP host follows the address rules", webIP + ":80", webIP, 403, "denied"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			status, body := w.get(tc.dst, tc.host)
			if status != tc.status || !strings.Contains(body, tc.body) {
				t.Fatalf("GET %s via %s = %d %q, want %d containing %q", tc.host, tc.dst, status, body, tc.status, tc.body)
			}
		})
	}
	t.Run("TLS by SNI", func(t *testing.T) {
		if got := w.tls(webIP+":443", "api.example.test"); got != "tls api.example.test" {
			t.Fatalf("allowed SNI: %q", got)
		}
		if got := w.tls(webIP+":443", "other.test"); !strings.HasPrefix(got, "error") {
			t.Fatalf("denied SNI reached the server: %q", got)
		}
		if got := w.tls(webIP+":443", "rebind.example.test"); !strings.HasPrefix(got, "error") {
			t.Fatalf("SNI resolving into a denied range: %q", got)
		}
	})
	t.Run("other ports by address", func(t *testing.T) {
		b, _ := io.ReadAll(w.dial(rawIP + ":8080"))
		if string(b) != "raw\n" {
			t.Fatalf("allowOut address: %q", b)
		}
		b, _ = io.ReadAll(w.dial(rebindIP + ":8080"))
		if len(b) != 0 {
			t.Fatalf("denied address answered %q", b)
		}
	})
	t.Run("another host on a kept-alive connection", func(t *testing.T) {
		c := w.dial(webIP + ":80")
		fmt.Fprintf(c, "GET / HTTP/1.1\r\nHost: www.example.test\r\n\r\nGET / HTTP/1.1\r\nHost: api.example.test\r\n\r\n")
		br := bufio.NewReader(c)
		resp, err := http.ReadResponse(br, nil)
		if err != nil || resp.StatusCode != 200 {
			t.Fatalf("first request: %v %v", resp, err)
		}
		io.Copy(io.Discard, resp.Body)
		if resp, err := http.ReadResponse(br, nil); err == nil {
			b, _ := io.ReadAll(resp.Body)
			t.Fatalf("the second host was served on the first one's connection: %s", b)
		}
	})
	t.Run("removed policy", func(t *testing.T) {
		w.proxy.Remove(src)
		if status, body := w.get(webIP+":80", "api.example.test"); status != 0 {
			t.Fatalf("no policy: %d %q", status, body)
		}
	})
}

func TestProxySOCKS5(t *testing.T) {
	w := newWorld(t)
	socks := &egresstest.SOCKS5{User: "u", Password: "p"}
	sl := listen(t, "127.77.2.1:1080")
	go socks.Serve(sl)
	src := netip.MustParseAddr("127.0.0.1")
	pol := sandbox.Egress{AllowInternet: true, AllowDomains: []string{"api.example.test"},
		Proxy: &sandbox.SOCKSProxy{Address: "127.77.2.1:1080", Username: "u", Password: "p"}}
	w.proxy.Set(src, pol)
	if status, body := w.get(rawIP+":80", "api.example.test"); status != 200 || body != "host=api.example.test auth=from-sandbox x=" {
		t.Fatalf("through SOCKS5: %d %q", status, body)
	}
	b, _ := io.ReadAll(w.dial(rawIP + ":8080"))
	if string(b) != "raw\n" {
		t.Fatalf("raw through SOCKS5: %q", b)
	}
	if got := fmt.Sprint(socks.Targets()); got != "["+webIP+":80 "+rawIP+":8080]" {
		t.Fatalf("SOCKS5 targets %s", got)
	}
	// Fails closed: wrong credentials, or a proxy in a denied range, reach nothing.
	pol.Proxy = &sandbox.SOCKSProxy{Address: "127.77.2.1:1080", Username: "u", Password: "wrong"}
	w.proxy.Set(src, pol)
	if status, _ := w.get(rawIP+":80", "api.example.test"); status != 403 {
		t.Fatalf("bad credentials: %d", status)
	}
	pol.Proxy = &sandbox.SOCKSProxy{Address: rebindIP + ":1080"}
	w.proxy.Set(src, pol)
	if status, body := w.get(rawIP+":80", "api.example.test"); status != 403 || !strings.Contains(body, "infrastructure") {
		t.Fatalf("proxy in a denied range: %d %q", status, body)
	}
}

// BenchmarkProxyHTTP: one HTTP request per connection, by name with a header transform,
// through the proxy (b/op: connection, decision, DNS lookup, dial, relay) and, for
// comparison, straight to the server.
func BenchmarkProxyHTTP(b *testing.B) {
	w := newWorld(b)
	w.proxy.Set(netip.MustParseAddr("127.0.0.1"), sandbox.Egress{AllowInternet: true, AllowDomains: []string{"*.example.test"},
		Rules: map[string][]sandbox.Transform{"api.example.test": {{Headers: map[string]string{"Authorization": "x"}}}}})
	b.Run("proxied", func(b *testing.B) {
		for range b.N {
			if status, body := w.get(webIP+":80", "api.example.test"); status != 200 {
				b.Fatal(status, body)
			}
		}
	})
	b.Run("direct", func(b *testing.B) {
		for range b.N {
			c, err := net.Dial("tcp4", webIP+":80")
			if err != nil {
				b.Fatal(err)
			}
			fmt.Fprintf(c, "GET / HTTP/1.1\r\nHost: api.example.test\r\nConnection: close\r\n\r\n")
			if _, err := io.ReadAll(c); err != nil {
				b.Fatal(err)
			}
			c.Close()
		}
	})
}
