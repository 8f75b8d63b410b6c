package egressproxy

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"strings"
	"time"

	"github.com/aenv-dev/aenv/internal/sandbox"
)

// http relays a plain HTTP/1 connection request by request: each request head is read,
// must name the host the connection was decided for (a different Host would reuse a
// connection, and maybe injected credentials, for another server: the connection is
// closed instead), gets the transforms of its host and is written upstream with its body
// streamed; responses flow back unparsed. After a protocol upgrade (WebSocket) the
// connection is relayed as bytes.
func (p *Proxy) http(ctx context.Context, c net.Conn, br *bufio.Reader, pol *sandbox.Egress, dst netip.AddrPort) {
	req, err := http.ReadRequest(br)
	_ = c.SetReadDeadline(time.Time{})
	if err != nil {
		return
	}
	host := sandbox.CanonicalHost(req.Host)
	up, named, err := p.connect(ctx, pol, dst, host)
	if err != nil {
		p.cfg.Logger.Debug("egress: refused", "dst", dst, "host", host, "err", err)
		refuse(c, err)
		return
	}
	defer up.Close()
	var rules []sandbox.Transform
	if named {
		rules, _ = sandbox.LookupRules(pol.Rules, host)
	}
	p.forward(c, br, req, up, host, rules)
}

// forward writes req and the requests that follow it on c (read from br) to up, each with
// the transforms of rules applied, and relays the responses back unparsed, until either
// side ends, a request names another host than host, or the connection is upgraded.
func (p *Proxy) forward(c net.Conn, br *bufio.Reader, req *http.Request, up net.Conn, host string, rules []sandbox.Transform) {
	done := make(chan struct{})
	go func() {
		_, _ = io.Copy(c, up)
		closeWrite(c)
		close(done)
	}()
	for {
		for _, r := range rules {
			for n, v := range r.Headers {
				req.Header.Set(n, v)
			}
		}
		if _, ok := req.Header["User-Agent"]; !ok {
			req.Header["User-Agent"] = []string{""} // Request.Write would add Go's
		}
		err := req.Write(up)
		if err != nil {
			break
		}
		if strings.EqualFold(req.Header.Get("Connection"), "upgrade") || req.Header.Get("Upgrade") != "" {
			_, _ = io.Copy(up, br)
			break
		}
		if req, err = http.ReadRequest(br); err != nil {
			break
		}
		if sandbox.CanonicalHost(req.Host) != host {
			p.cfg.Logger.Debug("egress: another host on a kept-alive connection", "host", req.Host, "first", host)
			break
		}
	}
	closeWrite(up)
	<-done
}

// refuse answers a refused HTTP request with 403 and the reason.
func refuse(c net.Conn, cause error) {
	answer(c, http.StatusForbidden, cause)
}

// answer writes a response of status with the reason as its body and no keep-alive.
func answer(c net.Conn, status int, cause error) {
	body := fmt.Sprintf("aenv egress proxy: %v\n", cause)
	fmt.Fprintf(c, "HTTP/1.1 %d %s\r\nContent-Type: text/plain; charset=utf-8\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s", status, http.StatusText(status), len(body), body)
}
