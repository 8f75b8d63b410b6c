// Package relay serves a request through an httputil.ReverseProxy without cutting the
// streams it relays (the node's sandbox proxy, the cluster gateway's forwarding to nodes).
package relay

import (
	"net/http"
	"net/http/httputil"
)

// Serve has rp serve r with the request body left to rp's transport until it is done.
//
// The request body belongs to the transport until it has seen EOF, and an upstream can
// answer before that: envd starts a Connect stream once it has the request envelope,
// while the transport, having sent Content-Length bytes, still has one read to make to
// check for more. By default an HTTP/1 server drains and closes the request body when the
// handler writes the response headers; that read then fails, the transport closes the
// upstream connection, and the stream it is relaying is cut ("terminated" in the SDK,
// "incomplete envelope: unexpected EOF" in a Connect client). Full duplex leaves the body
// to the transport, which also lets a request body keep streaming while the response
// does. HTTP/2 is always full duplex and reports ErrNotSupported.
func Serve(rp *httputil.ReverseProxy, w http.ResponseWriter, r *http.Request) {
	duplex := http.NewResponseController(w).EnableFullDuplex() == nil
	rp.ServeHTTP(w, r)
	if duplex {
		// Drain what the transport left unread while the handler still runs: drained after
		// it returns, the body's EOF starts the server's background read too late for it to
		// be stopped, and the next request on the client's connection panics in net/http
		// and drops the connection (golang/go#68560), e.g. after a 502 for an upstream that
		// refused the connection before the body was sent.
		r.Body.Close()
	}
}
