// Package relaytest holds the pieces tests of a relaying proxy use to stop its transport
// between sending a request's body and its last read of it, where an HTTP/1 server that
// wrote the response headers used to pull the body away.
package relaytest

import (
	"bufio"
	"bytes"
	"context"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"sync"
	"testing"
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

// StreamMsg is the request the early-answer scenario sends: a process.Start envelope.
var StreamMsg = []byte(`{"process":{"cmd":"/bin/bash","args":["-l","-c","echo hi"]}}`)

// EarlyAnswer is the scenario where an upstream (envd's process.Start) starts its stream
// once it has the request's bytes, before the relaying transport's last read of the
// request body: Upstream answers "start-event\n" at once and "end-event\n" when the test
// lets it; Transport holds its connections' body writes until the client has the response
// headers (see Check).
type EarlyAnswer struct {
	Upstream *httptest.Server

	finish, gate chan struct{}
	endOnce      sync.Once
	gateOnce     sync.Once
	conns        chan *GatedConn
	bodyDone     chan error
}

// NewEarlyAnswer starts the upstream; everything is released at the end of t.
func NewEarlyAnswer(t testing.TB) *EarlyAnswer {
	e := &EarlyAnswer{finish: make(chan struct{}), gate: make(chan struct{}),
		conns: make(chan *GatedConn, 4), bodyDone: make(chan error, 1)}
	t.Cleanup(e.end)
	t.Cleanup(e.open)
	e.Upstream = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if _, err := io.ReadFull(r.Body, make([]byte, len(StreamMsg))); err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		w.Header().Set("Content-Type", "application/connect+json")
		w.WriteHeader(http.StatusOK)
		io.WriteString(w, "start-event\n")
		w.(http.Flusher).Flush()
		<-e.finish
		io.WriteString(w, "end-event\n")
	}))
	t.Cleanup(e.Upstream.Close)
	return e
}

func (e *EarlyAnswer) end()  { e.endOnce.Do(func() { close(e.finish) }) }
func (e *EarlyAnswer) open() { e.gateOnce.Do(func() { close(e.gate) }) }

// Transport wraps tr: its connections are gated and its request bodies report their end.
// It sets tr.DialContext (keeping tr's own dialer, if any, underneath).
func (e *EarlyAnswer) Transport(tr *http.Transport) http.RoundTripper {
	dial := tr.DialContext
	if dial == nil {
		dial = (&net.Dialer{}).DialContext
	}
	tr.DialContext = func(ctx context.Context, network, addr string) (net.Conn, error) {
		c, err := dial(ctx, network, addr)
		if err != nil {
			return nil, err
		}
		gc := NewGatedConn(c, e.gate)
		e.conns <- gc
		return gc, nil
	}
	return RoundTripFunc(func(r *http.Request) (*http.Response, error) {
		r = r.Clone(r.Context())
		r.Body = &EOFSignal{ReadCloser: r.Body, Done: e.bodyDone}
		return tr.RoundTrip(r)
	})
}

// Check reads the first event of resp (the proxy's answer to StreamMsg), lets the
// transport make its last body read (bodyErr is what it got: io.EOF when the body was
// left to it), and reports whether the proxy then closed its upstream connection under
// the stream (cut). When it did not, the rest of the stream must arrive whole.
func (e *EarlyAnswer) Check(t testing.TB, resp *http.Response) (cut bool, bodyErr error) {
	t.Helper()
	br := bufio.NewReader(resp.Body)
	if l, err := br.ReadString('\n'); err != nil || l != "start-event\n" {
		t.Fatalf("first event = %q, %v", l, err)
	}
	e.open()
	select {
	case bodyErr = <-e.bodyDone:
	case <-time.After(10 * time.Second):
		t.Fatal("the transport never finished reading the request body")
	}
	// A transport that failed that read closes the connection right after it.
	select {
	case <-(<-e.conns).Closed:
		cut = true
	case <-time.After(200 * time.Millisecond):
	}
	e.end()
	rest, err := io.ReadAll(br)
	if !cut && (err != nil || string(rest) != "end-event\n") {
		t.Fatalf("rest of the stream = %q, %v", rest, err)
	}
	return cut, bodyErr
}
