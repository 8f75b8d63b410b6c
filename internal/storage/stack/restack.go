package stack

import (
	"context"
	"errors"
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
// It is Restack, then Persist, then CompactIfDeep; a caller that must keep
// the time I/O is quiesced short runs Restack alone inside that window and
// the other two after it.
//
// A failure before the seal leaves the stack unchanged; a failure after it
// marks the stack ErrBroken. A ref with an error means only the compaction
// failed: the sealed layer is good and durable.
func (s *Stack) SealAndRestack(ctx context.Context, output string) (LayerRef, error) {
	ref, err := s.Restack(ctx, output)
	if err != nil {
		return ref, err
	}
	if err := s.Persist(ref); err != nil {
		return LayerRef{}, err
	}
	if _, err := s.CompactIfDeep(ctx, output); err != nil {
		return ref, err
	}
	return ref, nil
}

// Persist makes what Restack did durable: the sealed layer at ref.Path, its
// directory entry, and the fresh upper's files. Nothing durable may refer to
// the sealed layer (a manifest, a capture record) before it returns. An error
// marks the stack ErrBroken: the upper's history may be lost.
func (s *Stack) Persist(ref LayerRef) error {
	s.mu.RLock()
	paths := s.persistPaths(ref)
	s.mu.RUnlock()
	pending := s.unpersisted.Load()
	for _, p := range paths {
		if err := s.syncPath(p); err != nil {
			s.mu.Lock()
			if s.broken == nil {
				s.broken = err
			}
			s.mu.Unlock()
			return fmt.Errorf("%w: persist restack: %v", ErrBroken, err)
		}
	}
	s.unpersisted.CompareAndSwap(pending, nil)
	s.mu.Lock()
	idx := s.sealedIndex
	s.sealedIndex = ""
	s.mu.Unlock()
	if idx != "" {
		if err := os.Remove(idx); err != nil && !errors.Is(err, os.ErrNotExist) {
			slog.Warn("stack: remove sealed upper's index", "path", idx, "err", err)
		}
	}
	return nil
}

// persistPaths lists what Persist fsyncs for ref: the upper's files, the sealed
// layer, and the directories that hold their names. The caller holds s.mu.
func (s *Stack) persistPaths(ref LayerRef) []string {
	var paths []string
	if u := s.m.Upper; u != nil {
		paths = append(paths, s.m.abs(u.Data))
		if !u.Sparse {
			paths = append(paths, s.m.abs(u.Index))
		}
	}
	paths = append(paths, ref.Path)
	dirs := []string{filepath.Dir(ref.Path)}
	if len(paths) > 1 && filepath.Dir(paths[0]) != dirs[0] {
		dirs = append(dirs, filepath.Dir(paths[0]))
	}
	return append(paths, dirs...)
}

// sealedIndex is where Restack moves a sealed upper's index file until Persist
// removes it (Open removes one a crash left).
func sealedIndex(index string) string { return index + ".sealed" }

// CompactIfDeep compacts the newest lowers into one layer next to output
// when the lower count exceeds the manifest's MaxDepth (Compact: I/O is not
// blocked). It returns the compacted layer's ref, or an empty one when the
// stack is not too deep.
func (s *Stack) CompactIfDeep(ctx context.Context, output string) (LayerRef, error) {
	s.mu.RLock()
	depth, maxDepth := len(s.lowers), s.m.MaxDepth
	s.mu.RUnlock()
	if maxDepth == 0 {
		maxDepth = DefaultMaxDepth
	}
	if depth <= maxDepth {
		return LayerRef{}, nil
	}
	ref, err := s.Compact(ctx, compactPath(output), depth-maxDepth+1)
	if err != nil {
		return LayerRef{}, fmt.Errorf("stack: restacked, but compaction failed: %w", err)
	}
	return ref, nil
}

// fsyncPath fsyncs a file or directory by name (a read-only descriptor is enough
// on Linux).
func fsyncPath(p string) error {
	f, err := os.Open(p)
	if err != nil {
		return err
	}
	err = f.Sync()
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return fmt.Errorf("fsync %s: %w", p, err)
	}
	return nil
}

func compactPath(output string) string {
	return strings.TrimSuffix(output, filepath.Ext(output)) + "-" + strings.ToLower(lsmt.NewUUID()[:8]) + ".compact"
}

// Restack is the part of SealAndRestack that swaps layers, without making
// anything durable: the sealed layer, its rename and the fresh upper are in
// the host's page cache (every reader sees them), and a host crash before
// Persist may lose them. It costs no disk flush and O(index entries) work.
func (s *Stack) Restack(ctx context.Context, output string) (LayerRef, error) {
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
	info, err := s.upper.SealUnsynced()
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
	if info.Index != "" {
		// Out of the fresh upper's way; Persist removes it.
		if err := os.Rename(info.Index, sealedIndex(info.Index)); err != nil {
			return fail(err)
		}
		s.sealedIndex = sealedIndex(info.Index)
	}
	ref := LayerRef{Path: output, Size: info.Size, UUID: info.UUID}
	lw, err := s.openLower(ctx, ref)
	if err != nil {
		return fail(err)
	}
	up, err := lsmt.CreateRW(dataPath, indexPath, lsmt.CreateOptions{VirtualSize: s.vsize, ParentUUID: info.UUID, Sparse: u.Sparse, Hybrid: u.Hybrid, NoSync: true})
	if err != nil {
		lw.close(s.opts.Lowers)
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
	s.dropMerged()
	s.merged = merged
	s.byTag = append([]*lower{lw}, s.byTag...)
	s.lowers = append(s.lowers, lw)
	s.upper = up
	s.m.Lowers = append(s.m.Lowers, ref)
	paths := s.persistPaths(ref)
	s.unpersisted.Store(&paths)
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
		lw.close(s.opts.Lowers)
		os.Remove(output)
		return LayerRef{}, fmt.Errorf("stack: compact: stack changed underneath")
	}
	rest := append([]*lower(nil), s.lowers[base+n:]...)
	s.lowers = append(append(s.lowers[:base:base], lw), rest...)
	refs := append([]LayerRef(nil), s.m.Lowers[base+n:]...)
	s.m.Lowers = append(append(s.m.Lowers[:base:base], ref), refs...)
	s.rebuild()
	for _, v := range victims {
		if err := v.close(s.opts.Lowers); err != nil {
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
