// Package egressproxy is the node's transparent egress proxy: nftables redirects the
// outbound TCP of sandboxes whose policy names domains, request transforms or a SOCKS5
// proxy (sandbox.Egress.NeedsProxy) to it. It reads the TLS SNI or the HTTP Host of a
// connection, decides by E2B's rules (allowOut by address or name, denyOut, internet
// access), checks the address it will dial against the infrastructure ranges after
// resolving the name itself (so a name that resolves, or rebinds, to cloud metadata or a
// private network reaches nothing), applies the transforms of network.rules to HTTP
// requests (over TLS too: connections to a name that has rules are terminated with a
// leaf of the node's CA, see CA) and dials directly or through the sandbox's SOCKS5 proxy.
package egressproxy

import (
	"bufio"
	"context"
	"crypto/x509"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/netip"
	"slices"
	"sync"
	"time"

	"github.com/aenv-dev/aenv/internal/sandbox"
)

// ErrDenied means the policy or the infrastructure ranges refuse a destination.
var ErrDenied = errors.New("egress denied")

// sniffTimeout bounds how long a client may take to send its ClientHello or request head.
const sniffTimeout = 10 * time.Second

// dialTimeout bounds a connection to a destination or a SOCKS5 server.
const dialTimeout = 10 * time.Second

// Config configures a Proxy.
type Config struct {
	// Deny are the infrastructure ranges no sandbox reaches (network.DefaultDenyRanges),
	// Allow the operator's exceptions inside them. Sandboxes' own subnet and the host's
	// addresses are refused whatever these say.
	Deny, Allow []netip.Prefix
	// Subnet is the sandboxes' subnet.
	Subnet netip.Prefix
	// Resolver resolves the names the proxy dials; nil is net.DefaultResolver. Give it the
	// sandboxes' nameservers so both see the same answers.
	Resolver *net.Resolver
	// OriginalDst returns where a redirected connection was headed; nil reads
	// SO_ORIGINAL_DST (nftables redirect).
	OriginalDst func(net.Conn) (netip.AddrPort, error)
	// HostAddr reports whether an address is the node's own; nil checks the host's
	// interfaces.
	HostAddr func(netip.Addr) bool
	// CA signs the certificates of intercepted TLS connections (those to names that have
	// network.rules); nil leaves every TLS connection end to end, transforms unapplied.
	CA *CA
	// UpstreamRoots verify the servers of intercepted connections; nil is the system's.
	UpstreamRoots *x509.CertPool
	Logger        *slog.Logger
}

// Proxy serves redirected connections by the policy of their source address.
type Proxy struct {
	cfg Config

	mu       sync.Mutex
	policies map[netip.Addr]*sandbox.Egress
	conns    map[net.Conn]struct{}
	closed   bool
	wg       sync.WaitGroup
}

// New returns a proxy with no policies: every connection is refused until Set.
func New(cfg Config) *Proxy {
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	if cfg.Resolver == nil {
		cfg.Resolver = net.DefaultResolver
	}
	if cfg.OriginalDst == nil {
		cfg.OriginalDst = originalDst
	}
	if cfg.HostAddr == nil {
		cfg.HostAddr = isHostAddr
	}
	return &Proxy{cfg: cfg, policies: map[netip.Addr]*sandbox.Egress{}, conns: map[net.Conn]struct{}{}}
}

// Set installs the policy of the sandbox at src; new connections use it.
func (p *Proxy) Set(src netip.Addr, e sandbox.Egress) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.policies[src] = &e
}

// Remove drops the policy of src: its connections are refused from now on.
func (p *Proxy) Remove(src netip.Addr) {
	p.mu.Lock()
	defer p.mu.Unlock()
	delete(p.policies, src)
}

func (p *Proxy) policy(src netip.Addr) *sandbox.Egress {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.policies[src]
}

// Serve accepts connections on l until it is closed. It always returns a non-nil error.
func (p *Proxy) Serve(l net.Listener) error {
	for {
		c, err := l.Accept()
		if err != nil {
			var ne net.Error
			if errors.As(err, &ne) && ne.Timeout() {
				continue
			}
			return err
		}
		if !p.track(c) {
			c.Close()
			return net.ErrClosed
		}
		go func() {
			defer p.untrack(c)
			p.handle(c)
		}()
	}
}

func (p *Proxy) track(c net.Conn) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return false
	}
	p.conns[c] = struct{}{}
	p.wg.Add(1)
	return true
}

func (p *Proxy) untrack(c net.Conn) {
	c.Close()
	p.mu.Lock()
	delete(p.conns, c)
	p.mu.Unlock()
	p.wg.Done()
}

// Close ends every connection in progress (the caller closes the listener).
func (p *Proxy) Close() {
	p.mu.Lock()
	p.closed = true
	for c := range p.conns {
		c.Close()
	}
	p.mu.Unlock()
	p.wg.Wait()
}

func (p *Proxy) handle(c net.Conn) {
	src, err := netip.ParseAddrPort(c.RemoteAddr().String())
	if err != nil {
		return
	}
	pol := p.policy(src.Addr().Unmap())
	if pol == nil {
		p.cfg.Logger.Debug("egress: connection from a sandbox without a proxied policy", "src", src)
		return
	}
	dst, err := p.cfg.OriginalDst(c)
	if err != nil {
		p.cfg.Logger.Warn("egress: original destination", "src", src, "err", err)
		return
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	br := bufio.NewReaderSize(c, 16<<10)
	if dst.Port() != 80 && dst.Port() != 443 {
		// Only web ports are inspected (as E2B does): a protocol whose server speaks
		// first would otherwise wait for a request head that never comes.
		p.raw(ctx, c, br, pol, dst, "")
		return
	}
	_ = c.SetReadDeadline(time.Now().Add(sniffTimeout))
	head, _ := br.Peek(1)
	switch {
	case len(head) == 1 && head[0] == 0x16:
		sni := peekSNI(br)
		_ = c.SetReadDeadline(time.Time{})
		if p.intercepts(pol, sni) {
			p.intercept(ctx, c, br, pol, dst, sni)
			return
		}
		p.raw(ctx, c, br, pol, dst, sni)
	case len(head) == 1 && isMethodStart(head[0]):
		p.http(ctx, c, br, pol, dst)
	default:
		_ = c.SetReadDeadline(time.Time{})
		p.raw(ctx, c, br, pol, dst, "")
	}
}

func isMethodStart(b byte) bool { return b >= 'A' && b <= 'Z' }

// raw relays a connection decided by its SNI (or by address when host is empty).
func (p *Proxy) raw(ctx context.Context, c net.Conn, br *bufio.Reader, pol *sandbox.Egress, dst netip.AddrPort, host string) {
	up, _, err := p.connect(ctx, pol, dst, host)
	if err != nil {
		p.cfg.Logger.Debug("egress: refused", "dst", dst, "host", host, "err", err)
		return
	}
	defer up.Close()
	relay(c, br, up)
}

// relay copies both ways until both directions end; br holds what was already read from c.
func relay(c net.Conn, br *bufio.Reader, up net.Conn) {
	done := make(chan struct{})
	go func() {
		_, _ = io.Copy(c, up)
		closeWrite(c)
		close(done)
	}()
	_, _ = io.Copy(up, br)
	closeWrite(up)
	<-done
}

func closeWrite(c net.Conn) {
	if cw, ok := c.(interface{ CloseWrite() error }); ok {
		_ = cw.CloseWrite()
		return
	}
	_ = c.Close()
}

// connect decides and dials. host is the SNI or Host name ("" when unknown, or an IP
// literal). A name the policy allows, or one that has rules, is resolved here and its
// addresses are dialled instead of the one the sandbox chose, so transforms only ever go
// to the named server and the infrastructure check sees the address really used. The
// returned bool says whether the destination is the server host names (rules apply).
func (p *Proxy) connect(ctx context.Context, pol *sandbox.Egress, dst netip.AddrPort, host string) (net.Conn, bool, error) {
	host = sandbox.CanonicalHost(host)
	if a, err := netip.ParseAddr(host); err == nil {
		// An IP literal names the server only if it is where the connection goes.
		if err := p.checkAddr(pol, dst.Addr(), false); err != nil {
			return nil, false, err
		}
		up, err := p.dial(ctx, pol, dst)
		return up, err == nil && a.Unmap() == dst.Addr(), err
	}
	byName := host != "" && slices.ContainsFunc(pol.AllowDomains, func(d string) bool { return sandbox.MatchDomain(d, host) })
	_, hasRules := sandbox.LookupRules(pol.Rules, host)
	if host == "" || (!byName && !hasRules) {
		if err := p.checkAddr(pol, dst.Addr(), false); err != nil {
			return nil, false, err
		}
		up, err := p.dial(ctx, pol, dst)
		return up, false, err
	}
	addrs, err := p.cfg.Resolver.LookupNetIP(ctx, "ip4", host)
	if err != nil {
		return nil, false, fmt.Errorf("%w: resolve %s: %v", ErrDenied, host, err)
	}
	var errs []error
	for _, a := range addrs {
		a = a.Unmap()
		if err := p.checkAddr(pol, a, byName); err != nil {
			errs = append(errs, err)
			continue
		}
		up, err := p.dial(ctx, pol, netip.AddrPortFrom(a, dst.Port()))
		if err == nil {
			return up, true, nil
		}
		errs = append(errs, err)
	}
	if len(errs) == 0 {
		return nil, false, fmt.Errorf("%w: %s has no IPv4 address", ErrDenied, host)
	}
	return nil, false, errors.Join(errs...)
}

// checkAddr applies the infrastructure ranges, then (unless a name already allowed the
// connection) the sandbox's address rules.
func (p *Proxy) checkAddr(pol *sandbox.Egress, a netip.Addr, allowedByName bool) error {
	if err := p.infra(a); err != nil {
		return err
	}
	if allowedByName || AddrAllowed(pol, a) {
		return nil
	}
	return fmt.Errorf("%w: %s by the sandbox's network rules", ErrDenied, a)
}

// AddrAllowed is E2B's order for an address: allowOut wins, then denyOut, then internet
// access.
func AddrAllowed(pol *sandbox.Egress, a netip.Addr) bool {
	for _, q := range pol.AllowOut {
		if q.Contains(a) {
			return true
		}
	}
	for _, q := range pol.DenyOut {
		if q.Contains(a) {
			return false
		}
	}
	return pol.AllowInternet
}

// infra refuses what no sandbox may reach whatever its rules: IPv6 (sandboxes have no
// route), their own subnet, the host's addresses, and the denied ranges outside the
// operator's exceptions.
func (p *Proxy) infra(a netip.Addr) error {
	a = a.Unmap()
	if !a.Is4() {
		return fmt.Errorf("%w: %s is not IPv4", ErrDenied, a)
	}
	if p.cfg.Subnet.IsValid() && p.cfg.Subnet.Contains(a) {
		return fmt.Errorf("%w: %s is a sandbox address", ErrDenied, a)
	}
	if p.cfg.HostAddr(a) {
		return fmt.Errorf("%w: %s is an address of the node", ErrDenied, a)
	}
	for _, q := range p.cfg.Allow {
		if q.Contains(a) {
			return nil
		}
	}
	for _, q := range p.cfg.Deny {
		if q.Contains(a) {
			return fmt.Errorf("%w: %s is in the infrastructure range %s", ErrDenied, a, q)
		}
	}
	return nil
}

func isHostAddr(a netip.Addr) bool {
	addrs, err := net.InterfaceAddrs()
	if err != nil {
		return true // fail closed
	}
	for _, ad := range addrs {
		if n, ok := ad.(*net.IPNet); ok {
			if h, ok := netip.AddrFromSlice(n.IP); ok && h.Unmap() == a {
				return true
			}
		}
	}
	return false
}
