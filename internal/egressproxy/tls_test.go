package egressproxy

import (
	"bufio"
	"bytes"
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"io"
	"log"
	"net/http"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/aenv-dev/aenv/internal/sandbox"
)

// serveHTTPS starts the "real" HTTPS server of *.example.test at httpsIP:443: its
// certificates come from upstream (a CA standing for the public roots), and the one for
// wrong.example.test names secure.example.test, so it fails verification.
func serveHTTPS(t *testing.T, upstream *CA) {
	t.Helper()
	l := tls.NewListener(listen(t, httpsIP+":443"), &tls.Config{GetCertificate: func(h *tls.ClientHelloInfo) (*tls.Certificate, error) {
		if h.ServerName == "wrong.example.test" {
			return upstream.Leaf("secure.example.test")
		}
		return upstream.Leaf(h.ServerName)
	}})
	srv := &http.Server{ErrorLog: log.New(io.Discard, "", 0), Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		fmt.Fprintf(w, "https host=%s auth=%s x=%s", r.Host, r.Header.Get("Authorization"), r.Header.Get("X-Extra"))
	})}
	go srv.Serve(l)
	t.Cleanup(func() { srv.Close() })
}

func pool(cas ...*CA) *x509.CertPool {
	p := x509.NewCertPool()
	for _, ca := range cas {
		p.AppendCertsFromPEM(ca.CertPEM())
	}
	return p
}

// httpsGet sends requests (Host: host each) over one TLS connection for sni trusting
// roots, and returns the issuer (key id) of the certificate the client saw and each answer.
func (w *world) httpsGet(sni string, roots *x509.CertPool, hosts ...string) (string, []string, error) {
	c := tls.Client(w.dial(httpsIP+":443"), &tls.Config{ServerName: sni, RootCAs: roots})
	if err := c.Handshake(); err != nil {
		return "", nil, err
	}
	issuer := string(c.ConnectionState().PeerCertificates[0].AuthorityKeyId)
	br := bufio.NewReader(c)
	var out []string
	for _, h := range hosts {
		fmt.Fprintf(c, "GET / HTTP/1.1\r\nHost: %s\r\nAuthorization: from-sandbox\r\n\r\n", h)
		resp, err := http.ReadResponse(br, nil)
		if err != nil {
			return issuer, out, err
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		out = append(out, fmt.Sprintf("%d %s", resp.StatusCode, strings.TrimSpace(string(b))))
	}
	return issuer, out, nil
}

func TestProxyInterceptsTLS(t *testing.T) {
	nodeCA, err := LoadOrCreateCA(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	upstream, err := LoadOrCreateCA(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	w := newWorld(t, func(c *Config) { c.CA, c.UpstreamRoots = nodeCA, pool(upstream) })
	serveHTTPS(t, upstream)
	w.proxy.Set(netip.MustParseAddr("127.0.0.1"), sandbox.Egress{
		AllowInternet: true, AllowDomains: []string{"*.example.test"},
		Rules: map[string][]sandbox.Transform{
			"secure.example.test": {{Headers: map[string]string{"Authorization": "Bearer injected"}}, {Headers: map[string]string{"X-Extra": "1"}}},
			"wrong.example.test":  {{Headers: map[string]string{"Authorization": "Bearer leaked"}}},
		},
	})
	nodeName := string(nodeCA.cert.SubjectKeyId)
	tests := []struct {
		name, sni string
		roots     *x509.CertPool
		hosts     []string
		issuer    string // "" = the handshake fails
		want      []string
	}{
		{"rules: terminated, headers set on every request", "secure.example.test", pool(nodeCA),
			[]string{"secure.example.test", "Secure.example.test:443"}, nodeName,
			[]string{"200 https host=secure.example.test auth=Bearer injected x=1", "200 https host=Secure.example.test:443 auth=Bearer injected x=1"}},
		{"rules: the client must trust the node CA", "secure.example.test", pool(upstream), nil, "", nil},
		{"no rules: not terminated here", "plain.example.test", pool(nodeCA), nil, "", nil},
		{"upstream certificate not valid for the name: 502, nothing sent", "wrong.example.test", pool(nodeCA),
			[]string{"wrong.example.test"}, nodeName, []string{"502 aenv egress proxy: TLS to wrong.example.test: tls: failed to verify certificate: x509: certificate is valid for secure.example.test, not wrong.example.test"}},
		{"another Host than the SNI: 421", "secure.example.test", pool(nodeCA),
			[]string{"plain.example.test"}, nodeName, []string{"421 aenv egress proxy: request for plain.example.test on a connection to secure.example.test"}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			issuer, got, err := w.httpsGet(tc.sni, tc.roots, tc.hosts...)
			if tc.issuer == "" {
				if err == nil {
					t.Fatalf("handshake succeeded (issuer %q)", issuer)
				}
				return
			}
			if err != nil || issuer != tc.issuer || strings.Join(got, "\n") != strings.Join(tc.want, "\n") {
				t.Fatalf("issuer %q, answers %q, err %v; want issuer %q, answers %q", issuer, got, err, tc.issuer, tc.want)
			}
		})
	}
	// Without rules the connection is the server's own: with the server's roots the
	// client reaches it untouched.
	issuer, got, err := w.httpsGet("plain.example.test", pool(upstream), "plain.example.test")
	if err != nil || issuer != string(upstream.cert.SubjectKeyId) || len(got) != 1 || got[0] != "200 https host=plain.example.test auth=from-sandbox x=" {
		t.Fatalf("passthrough: issuer %q answers %q err %v", issuer, got, err)
	}
}

func TestCA(t *testing.T) {
	dir := t.TempDir()
	ca, err := LoadOrCreateCA(dir)
	if err != nil {
		t.Fatal(err)
	}
	for f, mode := range map[string]os.FileMode{caFile: 0o644, caKeyFile: 0o600} {
		st, err := os.Stat(filepath.Join(dir, f))
		if err != nil || st.Mode().Perm() != mode {
			t.Fatalf("%s: %v %v, want mode %v", f, st.Mode(), err, mode)
		}
	}
	again, err := LoadOrCreateCA(dir)
	if err != nil || !bytes.Equal(again.CertPEM(), ca.CertPEM()) {
		t.Fatalf("reloaded CA differs: %v", err)
	}
	a, _ := ca.Leaf("a.example.test")
	if b, _ := ca.Leaf("a.example.test"); a != b {
		t.Fatal("leaf not cached")
	}
	if c, _ := ca.Leaf("c.example.test"); c == a || c.Leaf.DNSNames[0] != "c.example.test" {
		t.Fatal("leaf for another host")
	}
	// The leaf verifies against the reloaded CA alone, for its name only.
	opts := x509.VerifyOptions{Roots: pool(again), DNSName: "a.example.test"}
	if _, err := a.Leaf.Verify(opts); err != nil {
		t.Fatal(err)
	}
	opts.DNSName = "b.example.test"
	if _, err := a.Leaf.Verify(opts); err == nil {
		t.Fatal("leaf verified for another name")
	}
	if err := os.WriteFile(filepath.Join(dir, caKeyFile), []byte("garbage"), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := LoadOrCreateCA(dir); err == nil {
		t.Fatal("a CA with a broken key loaded")
	}
}
