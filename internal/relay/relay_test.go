package relay_test

import (
	"bufio"
	"bytes"
	"context"
	"io"
	"log"
	"net"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"sync"
	"testing"
	"time"

	"github.com/aenv-dev/aenv/internal/relay"
	"github.com/aenv-dev/aenv/internal/relay/relaytest"
)

// TestServeStreamSurvivesUpstreamAnsweringBeforeBodyEOF: an upstream that starts a stream
// once it has the request's bytes (envd's process.Start) answers before the transport's
// last read of the request body; the gate holds the transport there until the client has
// the response headers. With the server's default, writing those headers drained and
// closed the inbound body, the late read failed, the transport closed the upstream
// connection and the stream was cut: the cluster gateway's "ReverseProxy read error during
// body copy: use of closed network connection", "incomplete envelope: unexpected EOF" in
// the client (CI: TestClusterNetns).
func TestServeStreamSurvivesUpstreamAnsweringBeforeBodyEOF(t *testing.T) {
	for _, name := range []string{"relay.Serve", "ReverseProxy.ServeHTTP"} {
		t.Run(name, func(t *testing.T) {
			cut := testStream(t, name == "relay.Serve")
			if name == "relay.Serve" && cut {
				t.Fatal("the proxy closed its upstream connection while the stream was running")
			}
			if name != "relay.Serve" && !cut {
				t.Fatal("without relay.Serve the stream was not cut: the test no longer shows the race")
			}
		})
	}
}

// testStream relays one streamed answer through a proxy whose transport is held before
// its last body read, and reports whether the proxy's upstream connection was closed
// under the stream.
func testStream(t *testing.T, useRelay bool) (cut bool) {
	msg := []byte(`{"process":{"cmd":"/bin/bash","args":["-l","-c","echo hi"]}}`)
	finish := make(chan struct{})
	var finishOnce sync.Once
	endStream := func() { finishOnce.Do(func() { close(finish) }) }
	t.Cleanup(endStream)
	up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if _, err := io.ReadFull(r.Body, make([]byte, len(msg))); err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		w.WriteHeader(http.StatusOK)
		io.WriteString(w, "start-event\n")
		w.(http.Flusher).Flush()
		<-finish
		io.WriteString(w, "end-event\n")
	}))
	t.Cleanup(up.Close)
	target, _ := url.Parse(up.URL)

	gate := make(chan struct{})
	var gateOnce sync.Once
	openGate := func() { gateOnce.Do(func() { close(gate) }) }
	t.Cleanup(openGate)
	conns := make(chan *relaytest.GatedConn, 4)
	tr := &http.Transport{DialContext: func(ctx context.Context, network, addr string) (net.Conn, error) {
		c, err := (&net.Dialer{}).DialContext(ctx, network, addr)
		if err != nil {
			return nil, err
		}
		gc := relaytest.NewGatedConn(c, gate)
		conns <- gc
		return gc, nil
	}}
	t.Cleanup(tr.CloseIdleConnections)
	bodyDone := make(chan error, 1)
	rp := &httputil.ReverseProxy{
		Rewrite:       func(r *httputil.ProxyRequest) { r.SetURL(target) },
		FlushInterval: -1,
		Transport: relaytest.RoundTripFunc(func(r *http.Request) (*http.Response, error) {
			r = r.Clone(r.Context())
			r.Body = &relaytest.EOFSignal{ReadCloser: r.Body, Done: bodyDone}
			return tr.RoundTrip(r)
		}),
		ErrorLog: log.New(io.Discard, "", 0), // the plain proxy's cut stream is expected
	}
	front := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if useRelay {
			relay.Serve(rp, w, r)
		} else {
			rp.ServeHTTP(w, r)
		}
	}))
	t.Cleanup(front.Close)

	resp, err := front.Client().Post(front.URL+"/process.Process/Start", "application/connect+json", bytes.NewReader(msg))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	br := bufio.NewReader(resp.Body)
	if l, err := br.ReadString('\n'); err != nil || l != "start-event\n" {
		t.Fatalf("first event = %q, %v", l, err)
	}
	openGate()
	select {
	case <-bodyDone:
	case <-time.After(10 * time.Second):
		t.Fatal("the transport never finished reading the request body")
	}
	select {
	case <-(<-conns).Closed:
		cut = true
	case <-time.After(200 * time.Millisecond):
	}
	endStream()
	rest, err := io.ReadAll(br)
	if !cut && (err != nil || string(rest) != "end-event\n") {
		t.Fatalf("rest of the stream = %q, %v", rest, err)
	}
	return cut
}
