package network

import (
	"bytes"
	"context"
	"errors"
	"log/slog"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
)

// lockedBuffer is a log sink safe for the pool's goroutines.
type lockedBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *lockedBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *lockedBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

// TestReleaseReclaim: a released slot's namespace goes at once and its veth with it,
// deleted by the kernel (no warning that reclaim had to), and Settle waits for it; when
// something still holds the namespace, reclaim deletes the veth itself after
// reclaimWait, and the index is not handed out again while its veth is there.
func TestReleaseReclaim(t *testing.T) {
	needRoot(t)
	ctx := context.Background()
	logs := &lockedBuffer{}
	p := testPoolWith(t, Config{Bridge: "ntrclbr", Subnet: "10.89.9.0/24", Prefix: "ntrcl", PoolSize: -1,
		Logger: slog.New(slog.NewTextHandler(logs, nil))})
	p.reclaimWait = 300 * time.Millisecond
	settle := func() {
		t.Helper()
		sctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		defer cancel()
		if err := p.Settle(sctx); err != nil {
			t.Fatalf("settle: %v", err)
		}
	}

	t.Run("kernel deletes the veth", func(t *testing.T) {
		s, err := p.Acquire(ctx, true)
		if err != nil {
			t.Fatal(err)
		}
		if err := p.Release(ctx, s); err != nil {
			t.Fatal(err)
		}
		if err := p.Release(ctx, s); err != nil {
			t.Fatalf("second release: %v", err)
		}
		if _, err := os.Stat(s.NetnsPath); !errors.Is(err, os.ErrNotExist) {
			t.Fatalf("netns %s left after release: %v", s.Netns, err)
		}
		settle()
		if _, err := netlink.LinkByName(s.HostVeth); err == nil {
			t.Fatalf("veth %s left after settle", s.HostVeth)
		}
		if strings.Contains(logs.String(), "level=WARN") {
			t.Fatalf("reclaim had to act: %s", logs.String())
		}
	})

	t.Run("held namespace", func(t *testing.T) {
		s, err := p.Acquire(ctx, true)
		if err != nil {
			t.Fatal(err)
		}
		held, err := unix.Open(s.NetnsPath, unix.O_RDONLY|unix.O_CLOEXEC, 0)
		if err != nil {
			t.Fatal(err)
		}
		defer unix.Close(held)
		if err := p.Release(ctx, s); err != nil {
			t.Fatal(err)
		}
		other, err := p.Acquire(ctx, true)
		if err != nil {
			t.Fatal(err)
		}
		if other.Index == s.Index {
			t.Fatalf("index %d handed out again while its veth %s is there", s.Index, s.HostVeth)
		}
		if err := p.Release(ctx, other); err != nil {
			t.Fatal(err)
		}
		settle()
		if _, err := netlink.LinkByName(s.HostVeth); err == nil {
			t.Fatalf("veth %s of a held namespace left after reclaimWait", s.HostVeth)
		}
		if !strings.Contains(logs.String(), "still held") {
			t.Fatalf("no warning about the held namespace: %s", logs.String())
		}
		again, err := p.Acquire(ctx, true)
		if err != nil {
			t.Fatal(err)
		}
		if again.Index != s.Index {
			t.Errorf("index %d not free after its veth went (got %d)", s.Index, again.Index)
		}
		if err := p.Release(ctx, again); err != nil {
			t.Fatal(err)
		}
		settle()
	})
}
