// Package sandboxconn pools the node's HTTP connections into sandboxes (envd and user
// ports) per sandbox, shared by the proxy and the orchestrator, so the connection the
// orchestrator opened for a create's /health and /init carries the sandbox's first
// proxied request (the SDK's first command) instead of a new dial into its namespace.
package sandboxconn

import (
	"context"
	"encoding/hex"
	"hash/fnv"
	"io"
	"net"
	"net/http"
	"net/netip"
	"strings"
	"time"
)

type sandboxKey struct{}

// WithSandbox marks requests made with ctx as traffic of sandbox id: Pools gives them
// that sandbox's connections.
func WithSandbox(ctx context.Context, id string) context.Context {
	return context.WithValue(ctx, sandboxKey{}, id)
}

// NewTransport reaches sandboxes on their private addresses, and dials the pool names
// Pools gives requests as the addresses they stand for. No response-header or idle read
// timeout: background commands keep envd streams open for as long as they run.
func NewTransport() *http.Transport {
	d := &net.Dialer{Timeout: 5 * time.Second, KeepAlive: 30 * time.Second}
	return &http.Transport{
		Proxy: nil, // sandbox addresses are local; never route them through HTTP_PROXY
		DialContext: func(ctx context.Context, network, addr string) (net.Conn, error) {
			return d.DialContext(ctx, network, poolAddr(addr))
		},
		MaxIdleConns:          1024,
		MaxIdleConnsPerHost:   64,
		IdleConnTimeout:       30 * time.Second,
		ExpectContinueTimeout: time.Second,
		// Pass the client's Accept-Encoding through instead of transparently decompressing.
		DisableCompression: true,
	}
}

// Pools keeps the connections of each sandbox in a pool of their own. http.Transport
// pools keep-alive connections by address, and a slot's address goes to the next sandbox
// as soon as one is killed. A connection to the killed sandbox that is still pooled (no
// FIN from it reached the node before its namespace went) would carry the new sandbox's
// first request, and the new sandbox's kernel answers it with a reset: a 502 on the first
// command of a sandbox created right after another was killed. So the transport sees a
// name per sandbox and address (requests marked with WithSandbox), which its dialer maps
// back to the address. Unmarked requests share the address's pool.
type Pools struct{ T *http.Transport }

// New returns Pools over NewTransport.
func New() Pools { return Pools{T: NewTransport()} }

// poolSuffix ends the pool names; .invalid never resolves, should one escape.
const poolSuffix = ".sandbox.invalid"

// RoundTrip implements http.RoundTripper.
func (p Pools) RoundTrip(r *http.Request) (*http.Response, error) {
	id, _ := r.Context().Value(sandboxKey{}).(string)
	if id == "" {
		return p.T.RoundTrip(r)
	}
	name, ok := poolName(r.URL.Host, id)
	if !ok {
		return p.T.RoundTrip(r)
	}
	r = r.Clone(r.Context())
	r.URL.Host = name
	return p.T.RoundTrip(r)
}

// CloseIdleConnections lets http.Client and tests drop the pooled connections.
func (p Pools) CloseIdleConnections() { p.T.CloseIdleConnections() }

// poolName is the host:port the transport pools sandbox id's connections to hostPort
// under; false when hostPort is not an IP address and port.
func poolName(hostPort, id string) (string, bool) {
	host, port, err := net.SplitHostPort(hostPort)
	if err != nil {
		return "", false
	}
	ip, err := netip.ParseAddr(host)
	if err != nil {
		return "", false
	}
	h := fnv.New64a()
	io.WriteString(h, id)
	return net.JoinHostPort(hex.EncodeToString(ip.AsSlice())+"-"+hex.EncodeToString(h.Sum(nil))+poolSuffix, port), true
}

// poolAddr maps a pool name from poolName back to the sandbox's address; anything else
// is returned as it is.
func poolAddr(addr string) string {
	host, port, err := net.SplitHostPort(addr)
	if err != nil {
		return addr
	}
	label, ok := strings.CutSuffix(host, poolSuffix)
	if !ok {
		return addr
	}
	ipHex, _, _ := strings.Cut(label, "-")
	raw, err := hex.DecodeString(ipHex)
	if err != nil {
		return addr
	}
	ip, ok := netip.AddrFromSlice(raw)
	if !ok {
		return addr
	}
	return net.JoinHostPort(ip.String(), port)
}
