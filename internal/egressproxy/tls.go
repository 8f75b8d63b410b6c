package egressproxy

import (
	"bufio"
	"context"
	"crypto/tls"
	"fmt"
	"net"
	"net/http"
	"net/netip"
	"time"

	"github.com/aenv-dev/aenv/internal/sandbox"
)

// intercepts reports whether a TLS connection for sni is terminated here: only names
// that have network.rules are (the transforms need the requests), and only with a CA.
// Everything else stays end to end, decided by its SNI.
func (p *Proxy) intercepts(pol *sandbox.Egress, sni string) bool {
	if p.cfg.CA == nil || sni == "" {
		return false
	}
	_, ok := sandbox.LookupRules(pol.Rules, sandbox.CanonicalHost(sni))
	return ok
}

// intercept terminates a sandbox's TLS connection for sni with a leaf certificate of the
// node's CA and opens its own TLS connection to the server the name resolves to,
// verified against the system roots (Config.UpstreamRoots), then relays HTTP/1.1 requests
// with the transforms of sni's rules, as for plain HTTP. The decision (policy,
// infrastructure ranges, resolution by the proxy) is the one of any connection by name.
// Failures after the decision are answered over TLS with 502 and the reason, so the
// client sees why rather than a reset.
func (p *Proxy) intercept(ctx context.Context, c net.Conn, br *bufio.Reader, pol *sandbox.Egress, dst netip.AddrPort, sni string) {
	host := sandbox.CanonicalHost(sni)
	up, named, err := p.connect(ctx, pol, dst, host)
	if err != nil || !named {
		// Refused before any handshake, like a connection decided by its SNI alone.
		p.cfg.Logger.Debug("egress: refused", "dst", dst, "host", host, "err", err)
		if up != nil {
			up.Close()
		}
		return
	}
	defer up.Close()
	hctx, cancel := context.WithTimeout(ctx, dialTimeout)
	defer cancel()
	utls := tls.Client(up, &tls.Config{ServerName: host, RootCAs: p.cfg.UpstreamRoots, NextProtos: []string{"http/1.1"}})
	upErr := utls.HandshakeContext(hctx)
	if upErr == nil && utls.ConnectionState().NegotiatedProtocol != "" && utls.ConnectionState().NegotiatedProtocol != "http/1.1" {
		upErr = fmt.Errorf("server negotiated %q", utls.ConnectionState().NegotiatedProtocol)
	}

	leaf, err := p.cfg.CA.Leaf(host)
	if err != nil {
		p.cfg.Logger.Error("egress: leaf certificate", "host", host, "err", err)
		return
	}
	_ = c.SetDeadline(time.Now().Add(sniffTimeout))
	ctls := tls.Server(&bufferedConn{Conn: c, r: br}, &tls.Config{
		Certificates: []tls.Certificate{*leaf},
		NextProtos:   []string{"http/1.1"},
		MinVersion:   tls.VersionTLS12,
	})
	if err := ctls.HandshakeContext(hctx); err != nil {
		p.cfg.Logger.Debug("egress: sandbox TLS handshake", "host", host, "err", err)
		return
	}
	cbr := bufio.NewReaderSize(ctls, 16<<10)
	req, err := http.ReadRequest(cbr)
	_ = c.SetDeadline(time.Time{})
	if err != nil {
		return
	}
	if upErr != nil {
		p.cfg.Logger.Debug("egress: upstream TLS", "host", host, "err", upErr)
		answer(ctls, http.StatusBadGateway, fmt.Errorf("TLS to %s: %w", host, upErr))
		_ = ctls.CloseWrite()
		return
	}
	if h := sandbox.CanonicalHost(req.Host); h != host {
		answer(ctls, http.StatusMisdirectedRequest, fmt.Errorf("request for %s on a connection to %s", h, host))
		_ = ctls.CloseWrite()
		return
	}
	rules, _ := sandbox.LookupRules(pol.Rules, host)
	p.forward(ctls, cbr, req, utls, host, rules)
}

// bufferedConn reads through the reader that already holds the ClientHello.
type bufferedConn struct {
	net.Conn
	r *bufio.Reader
}

func (c *bufferedConn) Read(b []byte) (int, error) { return c.r.Read(b) }
