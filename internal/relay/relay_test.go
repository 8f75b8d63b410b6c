package relay_test

import (
	"bytes"
	"io"
	"log"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"testing"

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
	ea := relaytest.NewEarlyAnswer(t)
	target, _ := url.Parse(ea.Upstream.URL)
	tr := &http.Transport{}
	t.Cleanup(tr.CloseIdleConnections)
	rp := &httputil.ReverseProxy{
		Rewrite:       func(r *httputil.ProxyRequest) { r.SetURL(target) },
		FlushInterval: -1,
		Transport:     ea.Transport(tr),
		ErrorLog:      log.New(io.Discard, "", 0), // the plain proxy's cut stream is expected
	}
	front := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if useRelay {
			relay.Serve(rp, w, r)
		} else {
			rp.ServeHTTP(w, r)
		}
	}))
	t.Cleanup(front.Close)

	resp, err := front.Client().Post(front.URL+"/process.Process/Start", "application/connect+json", bytes.NewReader(relaytest.StreamMsg))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	cut, bodyErr := ea.Check(t, resp)
	if useRelay && bodyErr != io.EOF {
		t.Errorf("the transport's last read of the request body: %v, want EOF", bodyErr)
	}
	return cut
}
