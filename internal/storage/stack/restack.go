package stack

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"syscall"

	"github.com/aenv-dev/aenv/internal/storage/lsmt"
)

// SealAndRestack turns the live upper into the newest lower and opens a
// fresh upper at the same paths (upstream create_snapshot_and_restack):
// the upper is sealed in place (its index and a trailer are appended, no
// data is copied), renamed to output, reopened read-only and merged on top
// of the lowers, and an empty upper replaces it. output must be on the
// upper's filesystem. In-flight I/O completes first; new I/O waits only for
// the swap. The returned ref describes the sealed layer (Digest is left
// empty: hashing would cost O(data)).
//
// A failure before the seal leaves the stack unchanged; a failure after it
// marks the stack ErrBroken. When the lower count then exceeds the
// manifest's MaxDepth, the newest lowers are compacted into one layer
// (Compact) without blocking I/O.
func (s *Stack) SealAndRestack(ctx context.Context, output string) (LayerRef, error) {
	ref, err := s.sealAndRestack(ctx, output)
	if err != nil {
		return ref, err
	}
	s.mu.RLock()
	depth, maxDepth := len(s.lowers), s.m.MaxDepth
	s.mu.RUnlock()
	if maxDepth == 0 {
		maxDepth = DefaultMaxDepth
	}
	if depth > maxDepth {
		out := compactPath(output)
		if _, err := s.Compact(ctx, out, depth-maxDepth+1); err != nil {
			return ref, fmt.Errorf("stack: restacked, but compaction failed: %w", err)
		}
	}
	return ref, nil
}

func compactPath(output string) string {
	return strings.TrimSuffix(output, filepath.Ext(output)) + "-" + strings.ToLower(lsmt.NewUUID()[:8]) + ".compact"
}

func (s *Stack) sealAndRestack(ctx context.Context, output string) (LayerRef, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if err := s.writable(); err != nil {
		return LayerRef{}, err
	}
	if len(s.lowers) >= maxLowers-1 {
		return LayerRef{}, fmt.Errorf("stack: %d lowers, cannot add another", len(s.lowers))
	}
	if _, err := os.Lstat(output); err == nil {
		return LayerRef{}, fmt.Errorf("stack: restack output %s already exists", output)
	}
	if err := os.MkdirAll(filepath.Dir(output), 0o755); err != nil {
		return LayerRef{}, fmt.Errorf("stack: restack: %w", err)
	}
	u := s.m.Upper
	dataPath, indexPath := s.m.abs(u.Data), s.m.abs(u.Index)
	// The sealed upper is renamed, not copied: refuse up front (stack
	// unchanged) when output is on another filesystem.
	if !sameFS(filepath.Dir(output), filepath.Dir(dataPath)) {
		return LayerRef{}, fmt.Errorf("stack: restack output %s is not on the upper's filesystem", output)
	}
	info, err := s.upper.Seal()
	if err != nil {
		// Seal failed before anything was renamed; the upper may be
		// half-sealed, so the stack cannot continue.
		s.broken = err
		return LayerRef{}, fmt.Errorf("stack: seal upper: %w", err)
	}
	fail := func(err error) (LayerRef, error) {
		s.broken = err
		return LayerRef{}, fmt.Errorf("%w: %v", ErrBroken, err)
	}
	if err := os.Rename(dataPath, output); err != nil {
		return fail(err)
	}
	ref := LayerRef{Path: output, Size: info.Size, UUID: info.UUID}
	lw, err := s.openLower(ctx, ref)
	if err != nil {
		return fail(err)
	}
	up, err := lsmt.CreateRW(dataPath, indexPath, lsmt.CreateOptions{VirtualSize: s.vsize, ParentUUID: info.UUID, Sparse: u.Sparse, Hybrid: u.Hybrid})
	if err != nil {
		lw.l.Close()
		lw.src.Close()
		return fail(err)
	}
	// Shift the merged tags down one layer and overlay the new lower as tag 0.
	old := s.merged.Mappings()
	shifted := make([]lsmt.Mapping, len(old))
	for i, m := range old {
		m.Tag++
		shifted[i] = m
	}
	merged, err := lsmt.NewIndex(lsmt.Overlay(lw.l.Index().Mappings(), shifted))
	if err != nil {
		return fail(err)
	}
	s.merged = merged
	s.byTag = append([]*lower{lw}, s.byTag...)
	s.lowers = append(s.lowers, lw)
	s.upper = up
	s.m.Lowers = append(s.m.Lowers, ref)
	return ref, nil
}

// Compact merges the n newest lowers into one committed layer written to
// output and replaces them with it. Data is copied without holding the
// stack's lock (lowers are immutable); the swap is atomic. It returns the
// new layer's ref.
func (s *Stack) Compact(ctx context.Context, output string, n int) (LayerRef, error) {
	s.compact.Lock()
	defer s.compact.Unlock()
	s.mu.RLock()
	if err := s.usable(); err != nil {
		s.mu.RUnlock()
		return LayerRef{}, err
	}
	if n < 2 || n > len(s.lowers) {
		s.mu.RUnlock()
		return LayerRef{}, fmt.Errorf("stack: compact %d of %d lowers", n, len(s.lowers))
	}
	victims := append([]*lower(nil), s.lowers[len(s.lowers)-n:]...)
	vsize := s.vsize
	s.mu.RUnlock()

	idx := make([]*lsmt.Index, n)
	for i, lw := range victims {
		idx[n-1-i] = lw.l.Index()
	}
	merged := lsmt.Merge(idx)
	f, err := os.OpenFile(output, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o644)
	if err != nil {
		return LayerRef{}, fmt.Errorf("stack: compact: %w", err)
	}
	info, err := lsmt.Commit(f, lsmt.CommitSource{
		Mappings:    merged.Mappings(),
		VirtualSize: vsize,
		Read: func(tag uint8, p []byte, off int64) error {
			if err := ctx.Err(); err != nil {
				return err
			}
			return victims[n-1-int(tag)].l.ReadPhysical(p, off)
		},
	}, lsmt.CommitOptions{ParentUUID: s.parentOf(victims[0])})
	if err == nil {
		err = f.Sync()
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		os.Remove(output)
		return LayerRef{}, fmt.Errorf("stack: compact: %w", err)
	}
	ref := LayerRef{Path: output, Size: info.Size, UUID: info.UUID}
	lw, err := s.openLower(ctx, ref)
	if err != nil {
		os.Remove(output)
		return LayerRef{}, err
	}

	s.mu.Lock()
	defer s.mu.Unlock()
	base := len(s.lowers) - len(victims)
	// SealAndRestack may have added lowers on top meanwhile; find the victims.
	for base >= 0 && s.lowers[base] != victims[0] {
		base--
	}
	if base < 0 || s.usable() != nil {
		lw.l.Close()
		lw.src.Close()
		os.Remove(output)
		return LayerRef{}, fmt.Errorf("stack: compact: stack changed underneath")
	}
	rest := append([]*lower(nil), s.lowers[base+n:]...)
	s.lowers = append(append(s.lowers[:base:base], lw), rest...)
	refs := append([]LayerRef(nil), s.m.Lowers[base+n:]...)
	s.m.Lowers = append(append(s.m.Lowers[:base:base], ref), refs...)
	s.rebuild()
	for _, v := range victims {
		v.l.Close()
		if err := v.src.Close(); err != nil {
			slog.Warn("stack: close compacted lower", "layer", v.ref.Path, "err", err)
		}
	}
	return ref, nil
}

func (s *Stack) parentOf(lw *lower) string {
	return lw.l.Trailer().ParentUUID
}

// Commit flattens the whole stack (lowers and upper) into one committed
// layer written to w, as overlaybd-commit/merge do. It holds the stack's
// read lock, so writes wait until it finishes.
func (s *Stack) Commit(ctx context.Context, w io.Writer, o lsmt.CommitOptions) (lsmt.CommitInfo, error) {
	s.mu.RLock()
	defer s.mu.RUnlock()
	if err := s.usable(); err != nil {
		return lsmt.CommitInfo{}, err
	}
	ms := s.merged.Mappings()
	upperTag := uint8(len(s.lowers))
	if s.upper != nil {
		um := s.upper.Mappings()
		for i := range um {
			um[i].Tag = upperTag
		}
		ms = lsmt.Overlay(um, ms)
	}
	// Zeroed mappings over nothing are holes once the stack is flat.
	flat := ms[:0:0]
	for _, m := range ms {
		if !m.Zeroed {
			flat = append(flat, m)
		}
	}
	return lsmt.Commit(w, lsmt.CommitSource{Mappings: flat, VirtualSize: s.vsize,
		Read: func(tag uint8, p []byte, off int64) error {
			if err := ctx.Err(); err != nil {
				return err
			}
			if tag == upperTag && s.upper != nil {
				return s.upper.ReadPhysical(p, off)
			}
			return s.byTag[tag].l.ReadPhysical(p, off)
		}}, o)
}

func sameFS(a, b string) bool {
	var sa, sb syscall.Stat_t
	if syscall.Stat(a, &sa) != nil || syscall.Stat(b, &sb) != nil {
		return false
	}
	return sa.Dev == sb.Dev
}
