// Package p2p distributes sealed layers between the nodes of a cluster. A node serves
// the blobs it holds whole (its node cache: layers it published or fetched) over HTTP
// range requests to other nodes only (a cluster token, on a listener of its own, never
// the sandbox-facing API), at a bounded upload rate. A node that reads a layer lazily
// asks the scheduler which nodes hold it and reads its chunks from them, several peers
// at once, verifying every chunk against the layer's published block hash list and
// reading from the repository whatever a peer does not serve correctly.
package p2p

import (
	"context"
	"crypto/subtle"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"strings"
	"sync/atomic"
	"time"

	"golang.org/x/time/rate"

	"github.com/aenv-dev/aenv/internal/repository"
)

// BlobPath is the URL path prefix a node serves its blobs under: BlobPath + digest.
const BlobPath = "/p2p/v1/blobs/"

// LocalBlobs opens the blobs a node holds whole (a node cache); ok is false for a blob
// it does not hold, which it never fetches to answer a peer.
type LocalBlobs interface {
	OpenLocal(d repository.Digest) (br repository.BlobReader, ok bool, err error)
}

// ServerOptions configure a Server.
type ServerOptions struct {
	Blobs LocalBlobs
	// Token is the cluster's peer secret every request must carry as a bearer token.
	Token string
	// UploadBytesPerSec bounds what the node uploads to all peers together (0: no bound).
	UploadBytesPerSec int64
	Logger            *slog.Logger
}

// Server serves a node's blobs to its peers.
type Server struct {
	o   ServerOptions
	lim *rate.Limiter // nil: unbounded

	served, requests, refused atomic.Int64
}

// burst is the token bucket's depth and the largest write that waits for it once.
const burst = 256 << 10

// NewServer checks o and returns the server.
func NewServer(o ServerOptions) (*Server, error) {
	if o.Blobs == nil || o.Token == "" {
		return nil, errors.New("p2p: a server needs its blobs and the cluster token")
	}
	if o.UploadBytesPerSec < 0 {
		return nil, fmt.Errorf("p2p: upload bound %d bytes/s is negative", o.UploadBytesPerSec)
	}
	if o.Logger == nil {
		o.Logger = slog.Default()
	}
	s := &Server{o: o}
	if o.UploadBytesPerSec > 0 {
		s.lim = rate.NewLimiter(rate.Limit(o.UploadBytesPerSec), burst)
	}
	return s, nil
}

// ServerStats are the server's counters since it started.
type ServerStats struct {
	ServedBytes, Requests, Refused int64
}

// Stats returns the server's counters.
func (s *Server) Stats() ServerStats {
	return ServerStats{ServedBytes: s.served.Load(), Requests: s.requests.Load(), Refused: s.refused.Load()}
}

func (s *Server) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	s.requests.Add(1)
	tok, ok := strings.CutPrefix(r.Header.Get("Authorization"), "Bearer ")
	if !ok || subtle.ConstantTimeCompare([]byte(tok), []byte(s.o.Token)) != 1 {
		s.refused.Add(1)
		http.Error(w, "p2p: a peer request needs the cluster token", http.StatusUnauthorized)
		return
	}
	if r.Method != http.MethodGet && r.Method != http.MethodHead {
		http.Error(w, "p2p: GET or HEAD only", http.StatusMethodNotAllowed)
		return
	}
	name, ok := strings.CutPrefix(r.URL.Path, BlobPath)
	if !ok {
		http.NotFound(w, r)
		return
	}
	d, err := repository.ParseDigest(name)
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	br, ok, err := s.o.Blobs.OpenLocal(d)
	if err != nil {
		s.o.Logger.Warn("p2p: open a blob for a peer", "digest", d, "err", err)
		http.Error(w, "p2p: cannot open the blob", http.StatusInternalServerError)
		return
	}
	if !ok {
		http.Error(w, "p2p: this node does not hold "+string(d), http.StatusNotFound)
		return
	}
	defer br.Close()
	// Set so ServeContent does not read the blob to sniff a type.
	w.Header().Set("Content-Type", "application/octet-stream")
	lw := &limitedWriter{ResponseWriter: w, ctx: r.Context(), s: s}
	http.ServeContent(lw, r, "", time.Time{}, io.NewSectionReader(readerAt{ctx: r.Context(), br: br}, 0, br.Size()))
}

// limitedWriter passes a response through the node's upload token bucket.
type limitedWriter struct {
	http.ResponseWriter
	ctx context.Context
	s   *Server
}

func (w *limitedWriter) Write(p []byte) (int, error) {
	done := 0
	for done < len(p) {
		n := min(len(p)-done, burst)
		if w.s.lim != nil {
			if err := w.s.lim.WaitN(w.ctx, n); err != nil {
				return done, err
			}
		}
		m, err := w.ResponseWriter.Write(p[done : done+n])
		done += m
		w.s.served.Add(int64(m))
		if err != nil {
			return done, err
		}
	}
	return done, nil
}

type readerAt struct {
	ctx context.Context
	br  repository.BlobReader
}

func (r readerAt) ReadAt(p []byte, off int64) (int, error) { return r.br.ReadAt(r.ctx, p, off) }
