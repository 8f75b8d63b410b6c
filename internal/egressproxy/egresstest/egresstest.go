// Package egresstest has the servers egress tests talk to: a DNS server answering A
// queries from a fixed table and a SOCKS5 server that records what it was asked.
package egresstest

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"strings"
	"sync"

	"golang.org/x/net/dns/dnsmessage"
)

// ServeDNS answers A queries on pc from records (lowercase names without the trailing
// dot) until pc is closed; unknown names get NXDOMAIN.
func ServeDNS(pc net.PacketConn, records map[string]netip.Addr) {
	buf := make([]byte, 1500)
	for {
		n, from, err := pc.ReadFrom(buf)
		if err != nil {
			return
		}
		var p dnsmessage.Parser
		h, err := p.Start(buf[:n])
		if err != nil {
			continue
		}
		q, err := p.Question()
		if err != nil {
			continue
		}
		resp := dnsmessage.Message{
			Header:    dnsmessage.Header{ID: h.ID, Response: true, Authoritative: true, RecursionAvailable: true},
			Questions: []dnsmessage.Question{q},
		}
		name := strings.TrimSuffix(strings.ToLower(q.Name.String()), ".")
		a, ok := records[name]
		switch {
		case !ok:
			resp.Header.RCode = dnsmessage.RCodeNameError
		case q.Type == dnsmessage.TypeA:
			resp.Answers = []dnsmessage.Resource{{
				Header: dnsmessage.ResourceHeader{Name: q.Name, Type: dnsmessage.TypeA, Class: dnsmessage.ClassINET, TTL: 1},
				Body:   &dnsmessage.AResource{A: a.As4()},
			}}
		}
		out, err := resp.Pack()
		if err != nil {
			continue
		}
		_, _ = pc.WriteTo(out, from)
	}
}

// SOCKS5 is a minimal SOCKS5 server (CONNECT only, no or username/password auth).
type SOCKS5 struct {
	// User and Password, when User is set, are required (RFC 1929).
	User, Password string

	mu      sync.Mutex
	targets []string
}

// Targets are the CONNECT destinations asked so far.
func (s *SOCKS5) Targets() []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]string(nil), s.targets...)
}

// Serve accepts connections on l until it is closed.
func (s *SOCKS5) Serve(l net.Listener) {
	for {
		c, err := l.Accept()
		if err != nil {
			return
		}
		go func() {
			defer c.Close()
			up, err := s.handshake(c)
			if err != nil {
				return
			}
			defer up.Close()
			go func() { _, _ = io.Copy(up, c); up.(*net.TCPConn).CloseWrite() }()
			_, _ = io.Copy(c, up)
		}()
	}
}

func (s *SOCKS5) handshake(c net.Conn) (net.Conn, error) {
	var hdr [2]byte
	if _, err := io.ReadFull(c, hdr[:]); err != nil || hdr[0] != 5 {
		return nil, errors.New("not SOCKS5")
	}
	methods := make([]byte, hdr[1])
	if _, err := io.ReadFull(c, methods); err != nil {
		return nil, err
	}
	want := byte(0)
	if s.User != "" {
		want = 2
	}
	if !strings.ContainsRune(string(methods), rune(want)) {
		c.Write([]byte{5, 0xff})
		return nil, errors.New("no acceptable method")
	}
	c.Write([]byte{5, want})
	if want == 2 {
		var v [2]byte
		if _, err := io.ReadFull(c, v[:]); err != nil {
			return nil, err
		}
		user := make([]byte, v[1])
		io.ReadFull(c, user)
		var pl [1]byte
		io.ReadFull(c, pl[:])
		pass := make([]byte, pl[0])
		io.ReadFull(c, pass)
		if string(user) != s.User || string(pass) != s.Password {
			c.Write([]byte{1, 1})
			return nil, errors.New("bad credentials")
		}
		c.Write([]byte{1, 0})
	}
	var req [4]byte
	if _, err := io.ReadFull(c, req[:]); err != nil || req[1] != 1 {
		return nil, errors.New("not CONNECT")
	}
	var host string
	switch req[3] {
	case 1:
		var a [4]byte
		io.ReadFull(c, a[:])
		host = netip.AddrFrom4(a).String()
	case 3:
		var l [1]byte
		io.ReadFull(c, l[:])
		b := make([]byte, l[0])
		io.ReadFull(c, b)
		host = string(b)
	default:
		return nil, errors.New("address type")
	}
	var pb [2]byte
	io.ReadFull(c, pb[:])
	target := net.JoinHostPort(host, fmt.Sprint(binary.BigEndian.Uint16(pb[:])))
	s.mu.Lock()
	s.targets = append(s.targets, target)
	s.mu.Unlock()
	up, err := net.Dial("tcp", target)
	if err != nil {
		c.Write([]byte{5, 5, 0, 1, 0, 0, 0, 0, 0, 0})
		return nil, err
	}
	c.Write([]byte{5, 0, 0, 1, 0, 0, 0, 0, 0, 0})
	return up, nil
}
