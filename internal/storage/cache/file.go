package cache

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"hash/crc32"
	"io"
	"os"
	"path/filepath"
	"strconv"
	"sync"
)

// Block file layout: data (n bytes) | CRC-32C of each 4 KiB page (u32 LE) |
// u32 n | u32 magic. Per-page CRCs let a small read verify only what it
// touches.
const (
	pageSize   = 4096
	blockMagic = 0x31424341 // "ACB1"
)

var crcTable = crc32.MakeTable(crc32.Castagnoli)

// File is a cached, lazily fetched view of one Source. It implements
// io.ReaderAt and is safe for concurrent use.
type File struct {
	c    *Cache
	key  string
	dir  string
	src  Source
	size int64
	sums *Sums // nil: fetched blocks are not verified

	mu   sync.Mutex
	last int64 // last block read, for sequential prefetch
}

// Size is the source size.
func (f *File) Size() int64 { return f.size }

// Close is a no-op; cached blocks stay for other users.
func (f *File) Close() error { return nil }

func (f *File) blockName(k int64) string { return filepath.Join(f.dir, strconv.FormatInt(k, 10)) }

func (f *File) blockLen(k int64) int64 { return min(f.c.o.BlockSize, f.size-k*f.c.o.BlockSize) }

// ReadAt reads through the cache with a background context.
func (f *File) ReadAt(p []byte, off int64) (int, error) {
	return f.ReadAtContext(context.Background(), p, off)
}

// ReadAtContext reads [off, off+len(p)), fetching missing blocks.
func (f *File) ReadAtContext(ctx context.Context, p []byte, off int64) (int, error) {
	if off < 0 {
		return 0, fmt.Errorf("cache %s: negative offset", f.key)
	}
	if off >= f.size {
		return 0, io.EOF
	}
	want := p[:min(int64(len(p)), f.size-off)]
	bs := f.c.o.BlockSize
	done := 0
	for done < len(want) {
		pos := off + int64(done)
		k := pos / bs
		in := pos - k*bs
		n := min(int64(len(want)-done), f.blockLen(k)-in)
		if err := f.readBlock(ctx, k, want[done:done+int(n)], in); err != nil {
			return done, err
		}
		done += int(n)
		f.maybePrefetch(k)
	}
	f.c.read.Add(int64(done))
	if len(want) < len(p) {
		return done, io.EOF
	}
	return done, nil
}

// readBlock copies block k's bytes [in, in+len(dst)) into dst.
func (f *File) readBlock(ctx context.Context, k int64, dst []byte, in int64) error {
	name := f.blockName(k)
	blen := f.blockLen(k)
	err := f.readCached(name, blen, dst, in)
	if err == nil {
		f.c.hits.Add(1)
		f.c.touch(name, 0, false)
		return nil
	}
	if errors.Is(err, ErrCorrupt) {
		f.c.corrupt.Add(1)
		f.c.drop(name)
	}
	f.c.misses.Add(1)
	data, err := f.fetch(ctx, k)
	if err != nil {
		return err
	}
	copy(dst, data[in:])
	return nil
}

func (f *File) readCached(name string, blen int64, dst []byte, in int64) error {
	fh, err := os.Open(filepath.Join(f.c.o.Dir, name))
	if err != nil {
		return err
	}
	defer fh.Close()
	p0 := in / pageSize
	p1 := (in + int64(len(dst)) + pageSize - 1) / pageSize
	pend := min(p1*pageSize, blen)
	buf := make([]byte, pend-p0*pageSize)
	if _, err := fh.ReadAt(buf, p0*pageSize); err != nil {
		return fmt.Errorf("%w: %s: %v", ErrCorrupt, name, err)
	}
	crcs := make([]byte, 4*(p1-p0))
	if _, err := fh.ReadAt(crcs, blen+4*p0); err != nil {
		return fmt.Errorf("%w: %s: %v", ErrCorrupt, name, err)
	}
	for i := int64(0); i < p1-p0; i++ {
		pg := buf[i*pageSize : min((i+1)*pageSize, int64(len(buf)))]
		if crc32.Checksum(pg, crcTable) != binary.LittleEndian.Uint32(crcs[4*i:]) {
			return fmt.Errorf("%w: %s page %d", ErrCorrupt, name, p0+i)
		}
	}
	copy(dst, buf[in-p0*pageSize:])
	return nil
}

// fetch gets block k from the source once, however many readers miss on it
// at the same time, stores it and returns its bytes. With sums, what is
// fetched is verified first, a whole chunk at a time; a chunk larger than a
// block is fetched whole and all its blocks are stored.
func (f *File) fetch(ctx context.Context, k int64) ([]byte, error) {
	name := f.blockName(k)
	bs := f.c.o.BlockSize
	unit, first := bs, k // the fetched range: [first*bs, first*bs+unit)
	if f.sums != nil && f.sums.Chunk > bs {
		unit = f.sums.Chunk
		first = k * bs / unit * (unit / bs)
	}
	// Readers of other blocks of the same chunk share the flight, so it
	// returns the whole range it got and each slices out its block.
	type got struct {
		off  int64
		data []byte
	}
	v, err, _ := f.c.flight.Do(f.blockName(first)+"+"+strconv.FormatInt(unit, 10), func() (any, error) {
		off := first * bs
		buf := make([]byte, min(unit, f.size-off))
		// Another fetch (e.g. a prefetch) may have stored it just now.
		if unit == bs && f.readCached(name, int64(len(buf)), buf, 0) == nil {
			return got{off, buf}, nil
		}
		n, err := f.src.ReadAt(ctx, buf, off)
		if n != len(buf) {
			if err == nil || errors.Is(err, io.EOF) {
				err = io.ErrUnexpectedEOF
			}
			return nil, fmt.Errorf("cache %s: fetch block %d at offset %d: %w", f.key, k, off, err)
		}
		f.c.fetched.Add(int64(len(buf)))
		if err := f.verify(buf, off); err != nil {
			return nil, err
		}
		for b := first; b*bs < off+int64(len(buf)); b++ {
			if b != k && f.c.has(f.blockName(b)) {
				continue
			}
			// The data is good even if it could not be cached.
			if size, err := f.store(f.blockName(b), buf[(b-first)*bs:(b-first)*bs+f.blockLen(b)]); err == nil {
				f.c.touch(f.blockName(b), size, true)
			}
		}
		return got{off, buf}, nil
	})
	if err != nil {
		return nil, err
	}
	g := v.(got)
	in := k*bs - g.off
	return g.data[in : in+f.blockLen(k)], nil
}

func (f *File) store(name string, data []byte) (int64, error) {
	pages := (len(data) + pageSize - 1) / pageSize
	buf := make([]byte, len(data)+4*pages+8)
	copy(buf, data)
	for i := 0; i < pages; i++ {
		pg := data[i*pageSize : min((i+1)*pageSize, len(data))]
		binary.LittleEndian.PutUint32(buf[len(data)+4*i:], crc32.Checksum(pg, crcTable))
	}
	binary.LittleEndian.PutUint32(buf[len(buf)-8:], uint32(len(data)))
	binary.LittleEndian.PutUint32(buf[len(buf)-4:], blockMagic)
	path := filepath.Join(f.c.o.Dir, name)
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return 0, err
	}
	tmp, err := os.CreateTemp(filepath.Dir(path), filepath.Base(path)+".tmp*")
	if err != nil {
		return 0, err
	}
	_, err = tmp.Write(buf)
	if cerr := tmp.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Rename(tmp.Name(), path)
	}
	if err != nil {
		os.Remove(tmp.Name())
		return 0, err
	}
	return int64(len(buf)), nil
}

// Evict drops the cached blocks overlapping [off, off+n), e.g. after a
// consumer's own checksum (ZFile block CRC) failed on them.
func (f *File) Evict(off, n int64) {
	bs := f.c.o.BlockSize
	for k := off / bs; k*bs < off+n && k*bs < f.size; k++ {
		f.c.drop(f.blockName(k))
	}
}

func (f *File) maybePrefetch(k int64) {
	if f.c.o.Readahead == 0 {
		return
	}
	f.mu.Lock()
	seq := f.last == k-1
	f.last = k
	f.mu.Unlock()
	if !seq {
		return
	}
	for next := k + 1; next <= k+int64(f.c.o.Readahead) && next*f.c.o.BlockSize < f.size; next++ {
		if f.c.has(f.blockName(next)) {
			continue
		}
		select {
		case f.c.prefetchSem <- struct{}{}:
			f.c.prefetches.Add(1)
			go func() {
				defer f.c.prefetches.Done()
				defer func() { <-f.c.prefetchSem }()
				_, _ = f.fetch(context.Background(), next)
			}()
		default: // enough prefetches in flight
			return
		}
	}
}
