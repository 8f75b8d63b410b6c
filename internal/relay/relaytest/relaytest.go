// Package relaytest holds the pieces tests of a relaying proxy use to stop its transport
// between sending a request's body and its last read of it, where an HTTP/1 server that
// wrote the response headers used to pull the body away.
package relaytest

import (
	"bytes"
	"io"
	"net"
	"net/http"
	"sync"
	"time"
)

// GatedConn holds each write after the request headers (the body) until Gate is closed
// (at most 10 s), and closes Closed when it is closed itself.
type GatedConn struct {
	net.Conn
	Gate      <-chan struct{}
	Closed    chan struct{}
	closeOnce sync.Once
}

// NewGatedConn wraps c.
func NewGatedConn(c net.Conn, gate <-chan struct{}) *GatedConn {
	return &GatedConn{Conn: c, Gate: gate, Closed: make(chan struct{})}
}

func (c *GatedConn) Write(b []byte) (int, error) {
	n, err := c.Conn.Write(b)
	if !bytes.HasPrefix(b, []byte("POST ")) {
		select {
		case <-c.Gate:
		case <-time.After(10 * time.Second):
		}
	}
	return n, err
}

// Close closes the connection and reports it on Closed.
func (c *GatedConn) Close() error {
	c.closeOnce.Do(func() { close(c.Closed) })
	return c.Conn.Close()
}

// EOFSignal sends the first error its reader returns (io.EOF at the end) on Done.
type EOFSignal struct {
	io.ReadCloser
	Done chan<- error
	once sync.Once
}

func (b *EOFSignal) Read(p []byte) (int, error) {
	n, err := b.ReadCloser.Read(p)
	if err != nil {
		b.once.Do(func() { b.Done <- err })
	}
	return n, err
}

// RoundTripFunc is an http.RoundTripper.
type RoundTripFunc func(*http.Request) (*http.Response, error)

// RoundTrip calls f.
func (f RoundTripFunc) RoundTrip(r *http.Request) (*http.Response, error) { return f(r) }
