package p2p

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/aenv-dev/aenv/internal/repository"
	"github.com/aenv-dev/aenv/internal/storage/cache"
)

// PeerLister names the peers (base URLs) that hold a layer, this node excluded.
type PeerLister interface {
	Peers(ctx context.Context, layer repository.Digest) ([]string, error)
}

// FetcherOptions configure a Fetcher.
type FetcherOptions struct {
	Peers PeerLister
	// Token is the cluster's peer secret.
	Token string
	// Client makes the peer requests (default: a client with its own transport).
	Client *http.Client
	// Parallel bounds the chunks one read fetches at once (default 4).
	Parallel int
	// Timeout bounds one chunk's fetch from a peer before the repository is read
	// instead (default 5 s).
	Timeout time.Duration
	// ListTTL is how long a peer list is reused (default 2 s); PeerBackoff how long a
	// peer that failed is passed over (default 10 s).
	ListTTL, PeerBackoff time.Duration
	Logger               *slog.Logger
}

// Fetcher reads layers from peers first. It is safe for concurrent use.
type Fetcher struct {
	o FetcherOptions

	mu    sync.Mutex
	lists map[repository.Digest]peerList
	down  map[string]time.Time // peer URL, or URL + " " + digest after a bad chunk → until

	peerBytes, repoBytes, badChunks, peerErrors atomic.Int64
}

type peerList struct {
	urls []string
	at   time.Time
}

// NewFetcher checks o and returns the fetcher.
func NewFetcher(o FetcherOptions) (*Fetcher, error) {
	if o.Peers == nil || o.Token == "" {
		return nil, errors.New("p2p: a fetcher needs a peer lister and the cluster token")
	}
	if o.Client == nil {
		o.Client = &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 16, IdleConnTimeout: time.Minute}}
	}
	if o.Parallel <= 0 {
		o.Parallel = 4
	}
	if o.Timeout <= 0 {
		o.Timeout = 5 * time.Second
	}
	if o.ListTTL <= 0 {
		o.ListTTL = 2 * time.Second
	}
	if o.PeerBackoff <= 0 {
		o.PeerBackoff = 10 * time.Second
	}
	if o.Logger == nil {
		o.Logger = slog.Default()
	}
	return &Fetcher{o: o, lists: map[repository.Digest]peerList{}, down: map[string]time.Time{}}, nil
}

// FetcherStats are the fetcher's counters since it started.
type FetcherStats struct {
	// PeerBytes were read from peers and verified; RepositoryBytes were read from the
	// repository instead (no peer, a failed peer or a bad chunk).
	PeerBytes, RepositoryBytes int64
	// BadChunks did not match their published hash; PeerErrors are failed peer requests.
	BadChunks, PeerErrors int64
}

// Stats returns the fetcher's counters.
func (f *Fetcher) Stats() FetcherStats {
	return FetcherStats{PeerBytes: f.peerBytes.Load(), RepositoryBytes: f.repoBytes.Load(),
		BadChunks: f.badChunks.Load(), PeerErrors: f.peerErrors.Load()}
}

// Wrap returns a reader of layer d that reads each chunk from a peer, verified against
// sums, and from repo what no peer serves correctly. Its Close closes repo.
func (f *Fetcher) Wrap(d repository.Digest, repo repository.BlobReader, sums *cache.Sums) repository.BlobReader {
	return &blob{f: f, d: d, repo: repo, sums: sums}
}

// peers returns the peers to ask for d now: the scheduler's list (reused for ListTTL)
// less the peers in backoff. A scheduler that cannot answer means no peers.
func (f *Fetcher) peers(ctx context.Context, d repository.Digest) []string {
	now := time.Now()
	f.mu.Lock()
	l, ok := f.lists[d]
	f.mu.Unlock()
	if !ok || now.Sub(l.at) > f.o.ListTTL {
		lctx, cancel := context.WithTimeout(ctx, f.o.Timeout)
		urls, err := f.o.Peers.Peers(lctx, d)
		cancel()
		if err != nil {
			f.o.Logger.Debug("p2p: list peers; reading from the repository", "digest", d, "err", err)
		}
		l = peerList{urls: urls, at: now}
		f.mu.Lock()
		f.lists[d] = l
		f.mu.Unlock()
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	var out []string
	for _, u := range l.urls {
		if now.Before(f.down[u]) || now.Before(f.down[u+" "+string(d)]) {
			continue
		}
		out = append(out, u)
	}
	return out
}

func (f *Fetcher) backoff(key string) {
	f.mu.Lock()
	f.down[key] = time.Now().Add(f.o.PeerBackoff)
	f.mu.Unlock()
}

type blob struct {
	f    *Fetcher
	d    repository.Digest
	repo repository.BlobReader
	sums *cache.Sums
}

func (b *blob) Size() int64  { return b.repo.Size() }
func (b *blob) Close() error { return b.repo.Close() }

// ReadAt reads the whole chunks [off, off+len(p)) overlaps, each from one peer (chunk j
// from the j-th available peer, so reads spread over them), up to Parallel at once.
func (b *blob) ReadAt(ctx context.Context, p []byte, off int64) (int, error) {
	size := b.repo.Size()
	if off < 0 {
		return 0, fmt.Errorf("p2p: %s: negative offset", b.d)
	}
	if off >= size {
		return 0, io.EOF
	}
	end := min(off+int64(len(p)), size)
	peers := b.f.peers(ctx, b.d)
	if len(peers) == 0 {
		n, err := b.repo.ReadAt(ctx, p, off)
		b.f.repoBytes.Add(int64(n))
		return n, err
	}
	ch := b.sums.Chunk
	first, last := off/ch, (end-1)/ch
	buf := p[:end-off]
	if off%ch != 0 || (end%ch != 0 && end != size) {
		buf = make([]byte, min((last+1)*ch, size)-first*ch)
	}
	errs := make([]error, last-first+1)
	sem := make(chan struct{}, b.f.o.Parallel)
	var wg sync.WaitGroup
	for j := first; j <= last; j++ {
		seg := buf[(j-first)*ch : min((j-first+1)*ch, int64(len(buf)))]
		sem <- struct{}{}
		wg.Go(func() {
			defer func() { <-sem }()
			errs[j-first] = b.chunk(ctx, j, seg, peers[j%int64(len(peers))])
		})
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		return 0, err
	}
	n := int(end - off)
	if &buf[0] != &p[0] {
		copy(p, buf[off-first*ch:])
	}
	if n < len(p) {
		return n, io.EOF
	}
	return n, nil
}

// chunk fills seg with chunk j from peer, verified, or else from the repository.
func (b *blob) chunk(ctx context.Context, j int64, seg []byte, peer string) error {
	at := j * b.sums.Chunk
	err := b.fromPeer(ctx, peer, seg, at)
	if err == nil {
		if err = b.sums.Check(string(b.d), seg, at); err == nil {
			b.f.peerBytes.Add(int64(len(seg)))
			return nil
		}
		// A peer whose copy is bad is not asked for this layer again for a while.
		b.f.badChunks.Add(1)
		b.f.backoff(peer + " " + string(b.d))
		b.f.o.Logger.Warn("p2p: a peer served a chunk that does not match its published hash; reading it from the repository",
			"peer", peer, "digest", b.d, "chunk", j, "err", err)
	} else if ctx.Err() == nil {
		b.f.peerErrors.Add(1)
		key := peer
		if errors.Is(err, repository.ErrNotFound) {
			key = peer + " " + string(b.d)
		}
		b.f.backoff(key)
		b.f.o.Logger.Debug("p2p: peer fetch failed; reading the chunk from the repository", "peer", peer, "digest", b.d, "chunk", j, "err", err)
	}
	n, err := b.repo.ReadAt(ctx, seg, at)
	b.f.repoBytes.Add(int64(n))
	if n == len(seg) {
		return nil
	}
	if err == nil || errors.Is(err, io.EOF) {
		err = io.ErrUnexpectedEOF
	}
	return fmt.Errorf("p2p: %s chunk %d from the repository: %w", b.d, j, err)
}

func (b *blob) fromPeer(ctx context.Context, peer string, seg []byte, at int64) error {
	ctx, cancel := context.WithTimeout(ctx, b.f.o.Timeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, strings.TrimSuffix(peer, "/")+BlobPath+string(b.d), nil)
	if err != nil {
		return err
	}
	req.Header.Set("Authorization", "Bearer "+b.f.o.Token)
	req.Header.Set("Range", fmt.Sprintf("bytes=%d-%d", at, at+int64(len(seg))-1))
	resp, err := b.f.o.Client.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	switch {
	case resp.StatusCode == http.StatusNotFound:
		return fmt.Errorf("%w: peer %s does not hold %s", repository.ErrNotFound, peer, b.d)
	case resp.StatusCode != http.StatusPartialContent:
		return fmt.Errorf("peer %s: status %d", peer, resp.StatusCode)
	case resp.ContentLength != int64(len(seg)):
		return fmt.Errorf("peer %s: %d bytes for a %d-byte range", peer, resp.ContentLength, len(seg))
	}
	_, err = io.ReadFull(resp.Body, seg)
	return err
}
