package egressproxy

import (
	"bufio"
	"bytes"
	"context"
	"crypto/tls"
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"strconv"
	"syscall"

	"golang.org/x/net/proxy"
	"golang.org/x/sys/unix"

	"github.com/aenv-dev/aenv/internal/sandbox"
)

// dial connects to dst, directly or through the sandbox's SOCKS5 proxy. Through a proxy
// the address is already decided (resolved and checked here), so the proxy is only asked
// for an IP address and cannot be told a name that it would resolve differently.
func (p *Proxy) dial(ctx context.Context, pol *sandbox.Egress, dst netip.AddrPort) (net.Conn, error) {
	ctx, cancel := context.WithTimeout(ctx, dialTimeout)
	defer cancel()
	var d net.Dialer
	if pol.Proxy == nil {
		return d.DialContext(ctx, "tcp4", dst.String())
	}
	c, err := p.dialSOCKSServer(ctx, pol.Proxy.Address)
	if err != nil {
		return nil, err
	}
	var auth *proxy.Auth
	if pol.Proxy.Username != "" {
		auth = &proxy.Auth{User: pol.Proxy.Username, Password: pol.Proxy.Password}
	}
	sd, err := proxy.SOCKS5("tcp", pol.Proxy.Address, auth, nil)
	if err != nil {
		c.Close()
		return nil, fmt.Errorf("egress: SOCKS5 proxy %s: %w", pol.Proxy.Address, err)
	}
	// Handshake on our own TCP connection, so the relay keeps a *net.TCPConn (half
	// closes) rather than the library's wrapper.
	hs, ok := sd.(interface {
		DialWithConn(ctx context.Context, c net.Conn, network, address string) (net.Addr, error)
	})
	if !ok {
		c.Close()
		return nil, errors.New("egress: SOCKS5 dialer cannot use an existing connection")
	}
	if _, err := hs.DialWithConn(ctx, c, "tcp", dst.String()); err != nil {
		c.Close()
		return nil, fmt.Errorf("egress: SOCKS5 proxy %s to %s: %w", pol.Proxy.Address, dst, err)
	}
	return c, nil
}

// dialSOCKSServer connects to a sandbox's SOCKS5 server: its name is resolved now and the
// address checked against the infrastructure ranges like any destination (the proxy is
// the user's, on the internet, never the node's neighbours).
func (p *Proxy) dialSOCKSServer(ctx context.Context, address string) (net.Conn, error) {
	host, port, err := net.SplitHostPort(address)
	if err != nil {
		return nil, fmt.Errorf("egress: SOCKS5 proxy address %q: %w", address, err)
	}
	n, err := strconv.Atoi(port)
	if err != nil {
		return nil, fmt.Errorf("egress: SOCKS5 proxy address %q: bad port", address)
	}
	addrs, err := p.cfg.Resolver.LookupNetIP(ctx, "ip4", host)
	if err != nil {
		return nil, fmt.Errorf("%w: resolve SOCKS5 proxy %s: %v", ErrDenied, host, err)
	}
	var errs []error
	var d net.Dialer
	for _, a := range addrs {
		if err := p.infra(a); err != nil {
			errs = append(errs, fmt.Errorf("SOCKS5 proxy: %w", err))
			continue
		}
		c, err := d.DialContext(ctx, "tcp4", netip.AddrPortFrom(a.Unmap(), uint16(n)).String())
		if err == nil {
			return c, nil
		}
		errs = append(errs, err)
	}
	if len(errs) == 0 {
		return nil, fmt.Errorf("%w: SOCKS5 proxy %s has no IPv4 address", ErrDenied, host)
	}
	return nil, errors.Join(errs...)
}

// errSNI stops the TLS handshake once the ClientHello was parsed.
var errSNI = errors.New("sni read")

// peekSNI returns the server name of the TLS ClientHello at the head of br without
// consuming it ("" when there is none or the record is not a ClientHello).
func peekSNI(br *bufio.Reader) string {
	hdr, err := br.Peek(5)
	if err != nil || hdr[0] != 0x16 {
		return ""
	}
	n := int(binary.BigEndian.Uint16(hdr[3:5]))
	rec, err := br.Peek(5 + n)
	if err != nil {
		return ""
	}
	var sni string
	cfg := &tls.Config{GetConfigForClient: func(h *tls.ClientHelloInfo) (*tls.Config, error) {
		sni = h.ServerName
		return nil, errSNI
	}}
	_ = tls.Server(readOnlyConn{r: bytes.NewReader(rec)}, cfg).Handshake()
	return sni
}

// readOnlyConn feeds recorded bytes to crypto/tls and swallows what it writes.
type readOnlyConn struct {
	net.Conn
	r *bytes.Reader
}

func (c readOnlyConn) Read(b []byte) (int, error)  { return c.r.Read(b) }
func (c readOnlyConn) Write(b []byte) (int, error) { return len(b), nil }
func (c readOnlyConn) Close() error                { return nil }

// originalDst reads where nftables' redirect found the connection headed
// (SO_ORIGINAL_DST of the conntrack entry).
func originalDst(c net.Conn) (netip.AddrPort, error) {
	sc, ok := c.(syscall.Conn)
	if !ok {
		return netip.AddrPort{}, errors.New("not a socket")
	}
	raw, err := sc.SyscallConn()
	if err != nil {
		return netip.AddrPort{}, err
	}
	var mreq *unix.IPv6Mreq
	var gerr error
	if err := raw.Control(func(fd uintptr) {
		mreq, gerr = unix.GetsockoptIPv6Mreq(int(fd), unix.SOL_IP, unix.SO_ORIGINAL_DST)
	}); err != nil {
		return netip.AddrPort{}, err
	}
	if gerr != nil {
		return netip.AddrPort{}, fmt.Errorf("SO_ORIGINAL_DST: %w", gerr)
	}
	// struct sockaddr_in: family (2), port (2, big endian), address (4).
	b := mreq.Multiaddr
	port := binary.BigEndian.Uint16(b[2:4])
	return netip.AddrPortFrom(netip.AddrFrom4([4]byte{b[4], b[5], b[6], b[7]}), port), nil
}
