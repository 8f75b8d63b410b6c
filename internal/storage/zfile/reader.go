package zfile

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"sync"

	"github.com/klauspost/compress/zstd"
	"github.com/pierrec/lz4/v4"
)

// maxBatch bounds one coalesced read of compressed blocks (C++ MAX_READ_SIZE).
const maxBatch = 64 << 10

// readRetries is how often a block failing its CRC is re-read after asking
// the source to evict it, as upstream does with its cache.
const readRetries = 3

// Evicter is implemented by sources that cache bytes and can drop a range,
// so a block that fails its CRC is fetched again rather than failing at once.
type Evicter interface {
	Evict(off, n int64)
}

// Reader gives random access to the decompressed contents of a ZFile.
// It is safe for concurrent use.
type Reader struct {
	r       io.ReaderAt
	name    string
	hdr     Header  // the header block as found at offset 0
	h       Header  // effective fields (trailer, or header when overwritten)
	trl     *Header // the trailer block, when it parses
	offs    []uint64
	scratch sync.Pool // one decompressed block
	raw     sync.Pool // one batch of compressed blocks (rawCap bytes)
	rawCap  int
	zdec    *zstd.Decoder

	// cache, when set, keeps decompressed blocks (see UseCache) under cacheID.
	cache   *BlockCache
	cacheID uint64
}

// UseCache makes the reader keep the blocks it decompresses in c and read them from there
// again. Call it before the first read.
func (z *Reader) UseCache(c *BlockCache) {
	z.cache, z.cacheID = c, c.id()
}

// Open parses the ZFile in r (size bytes) and loads its jump table. name
// appears in errors.
func Open(r io.ReaderAt, size int64, name string) (*Reader, error) {
	if size < 2*HeaderSize {
		return nil, fmt.Errorf("%s: %w: file is %d bytes, shorter than header and trailer", name, ErrFormat, size)
	}
	b := make([]byte, HeaderSize)
	if _, err := r.ReadAt(b, 0); err != nil {
		return nil, fmt.Errorf("%s: read header at offset 0: %w", name, err)
	}
	hdr, err := ParseHeader(b)
	if err != nil {
		return nil, fmt.Errorf("%s: header at offset 0: %w", name, err)
	}
	if hdr.Flags&FlagHeader == 0 {
		return nil, fmt.Errorf("%s: %w: block at offset 0 has flags %#x, not a header", name, ErrFormat, hdr.Flags)
	}
	h := hdr
	toff := size - HeaderSize
	var trl *Header
	if _, err := r.ReadAt(b, toff); err == nil {
		trl, _ = ParseHeader(b)
	}
	if hdr.Flags&FlagOverwrite == 0 {
		if _, err := r.ReadAt(b, toff); err != nil {
			return nil, fmt.Errorf("%s: read trailer at offset %d: %w", name, toff, err)
		}
		if h, err = ParseHeader(b); err != nil {
			return nil, fmt.Errorf("%s: trailer at offset %d: %w", name, toff, err)
		}
		if h.Flags&(FlagHeader|FlagData|FlagSealed) != FlagData|FlagSealed {
			return nil, fmt.Errorf("%s: %w: trailer at offset %d has flags %#x, want data+sealed", name, ErrFormat, toff, h.Flags)
		}
	}
	if err := checkFields(h, uint64(toff)); err != nil {
		return nil, fmt.Errorf("%s: %w", name, err)
	}
	jt := make([]byte, 4*h.IndexSize)
	if _, err := r.ReadAt(jt, int64(h.IndexOffset)); err != nil {
		return nil, fmt.Errorf("%s: read jump table at offset %d: %w", name, h.IndexOffset, err)
	}
	if h.Flags&FlagCalcDigest != 0 {
		if got := CRC32CRaw(jt); got != h.IndexCRC {
			return nil, fmt.Errorf("%s: %w: jump table at offset %d: index_crc %#08x, computed %#08x",
				name, ErrChecksum, h.IndexOffset, h.IndexCRC, got)
		}
	}
	z := &Reader{r: r, name: name, hdr: *hdr, h: *h, trl: trl, offs: make([]uint64, h.IndexSize+1)}
	z.offs[0] = HeaderSize + uint64(h.DictSize)
	minLen := uint64(1)
	if h.Verify {
		minLen = blockCRCLen + 1
	}
	for i := uint64(0); i < h.IndexSize; i++ {
		l := uint64(binary.LittleEndian.Uint32(jt[4*i:]))
		if l < minLen || l > uint64(h.BlockSize)*2+64 {
			return nil, fmt.Errorf("%s: %w: jump table entry %d (offset %d): block length %d out of range",
				name, ErrFormat, i, h.IndexOffset+4*i, l)
		}
		z.offs[i+1] = z.offs[i] + l
	}
	if z.offs[h.IndexSize] != h.IndexOffset {
		return nil, fmt.Errorf("%s: %w: blocks end at %d but the jump table starts at %d",
			name, ErrFormat, z.offs[h.IndexSize], h.IndexOffset)
	}
	bs := int(h.BlockSize)
	z.scratch.New = func() any { b := make([]byte, bs); return &b }
	// A batch is at most maxBatch bytes, or one block longer than that.
	z.rawCap = max(maxBatch, 2*bs+64)
	z.raw.New = func() any { b := make([]byte, z.rawCap); return &b }
	if h.Algo == AlgoZstd {
		z.zdec, err = zstd.NewReader(nil, zstd.WithDecoderConcurrency(0), zstd.WithDecoderMaxMemory(1<<20))
		if err != nil {
			return nil, fmt.Errorf("%s: zstd: %w", name, err)
		}
	}
	return z, nil
}

func checkFields(h *Header, toff uint64) error {
	switch {
	case h.Algo != AlgoLZ4 && h.Algo != AlgoZstd:
		return fmt.Errorf("%w: unsupported algorithm %s", ErrFormat, h.Algo)
	case h.BlockSize < 512 || h.BlockSize > maxBlock || h.BlockSize&(h.BlockSize-1) != 0:
		return fmt.Errorf("%w: block size %d not a power of two in [512, %d]", ErrFormat, h.BlockSize, maxBlock)
	case h.Flags&FlagIdxComp != 0:
		return fmt.Errorf("%w: compressed jump table (IDX_COMP) not supported", ErrFormat)
	case h.UseDict != 0 || h.DictSize != 0:
		return fmt.Errorf("%w: dictionaries not supported (dict_size %d)", ErrFormat, h.DictSize)
	case h.IndexSize > maxBlocks:
		return fmt.Errorf("%w: index_size %d blocks exceeds limit", ErrFormat, h.IndexSize)
	case h.IndexOffset < HeaderSize || h.IndexOffset > toff || 4*h.IndexSize > toff-h.IndexOffset:
		return fmt.Errorf("%w: jump table of %d entries at offset %d does not fit before the trailer at %d",
			ErrFormat, h.IndexSize, h.IndexOffset, toff)
	case (h.OriginalFileSize+uint64(h.BlockSize)-1)/uint64(h.BlockSize) != h.IndexSize:
		return fmt.Errorf("%w: %d blocks cannot hold original size %d at block size %d",
			ErrFormat, h.IndexSize, h.OriginalFileSize, h.BlockSize)
	}
	return nil
}

// Size is the decompressed size.
func (z *Reader) Size() int64 { return int64(z.h.OriginalFileSize) }

// Header returns the header block found at offset 0.
func (z *Reader) Header() Header { return z.hdr }

// Trailer returns the effective index fields (the trailer's unless the header
// was overwritten with them).
func (z *Reader) Trailer() Header { return z.h }

// RawTrailer returns the trailer block at the end of the file, if it parses
// (with HEADER_OVERWRITE the reader uses the header's copy of its fields).
func (z *Reader) RawTrailer() (Header, bool) {
	if z.trl == nil {
		return Header{}, false
	}
	return *z.trl, true
}

// Blocks is the number of blocks.
func (z *Reader) Blocks() int { return int(z.h.IndexSize) }

// BlockLength is the encoded length of block i, CRC included.
func (z *Reader) BlockLength(i int) int { return int(z.offs[i+1] - z.offs[i]) }

// ReadAt reads decompressed bytes; it returns io.EOF at the end.
func (z *Reader) ReadAt(p []byte, off int64) (int, error) {
	size := int64(z.h.OriginalFileSize)
	if off < 0 {
		return 0, fmt.Errorf("%s: negative offset %d", z.name, off)
	}
	if off >= size {
		return 0, io.EOF
	}
	want := p
	if int64(len(p)) > size-off {
		want = p[:size-off]
	}
	bs := int64(z.h.BlockSize)
	done := 0
	for done < len(want) {
		b0 := (off + int64(done)) / bs
		if z.cache != nil {
			if data, ok := z.cache.get(z.cacheID, int(b0)); ok {
				done += copy(want[done:], data[off+int64(done)-b0*bs:])
				continue
			}
		}
		// Coalesce whole blocks up to maxBatch compressed bytes, and up to the next
		// cached one.
		b1 := b0 + 1
		last := (off + int64(len(want)) - 1) / bs
		for b1 <= last && z.offs[b1+1]-z.offs[b0] <= maxBatch && (z.cache == nil || !z.cache.has(z.cacheID, int(b1))) {
			b1++
		}
		n, err := z.readBlocks(want[done:], off+int64(done), int(b0), int(b1))
		done += n
		if err != nil {
			return done, err
		}
	}
	if len(want) < len(p) {
		return done, io.EOF
	}
	return done, nil
}

// readBlocks decodes blocks [b0, b1) and copies the part from off on into p.
func (z *Reader) readBlocks(p []byte, off int64, b0, b1 int) (int, error) {
	n := int(z.offs[b1] - z.offs[b0])
	var raw []byte
	if n <= z.rawCap {
		rp := z.raw.Get().(*[]byte)
		defer z.raw.Put(rp)
		raw = (*rp)[:n]
	} else {
		raw = make([]byte, n)
	}
	var err error
	for try := 0; ; try++ {
		if err = readFull(z.r, raw, int64(z.offs[b0])); err != nil {
			return 0, fmt.Errorf("%s: read blocks %d..%d at offset %d: %w", z.name, b0, b1-1, z.offs[b0], err)
		}
		if err = z.checkBlocks(raw, b0, b1); err == nil || try == readRetries {
			break
		}
		ev, ok := z.r.(Evicter)
		if !ok {
			break
		}
		ev.Evict(int64(z.offs[b0]), int64(len(raw)))
	}
	if err != nil {
		return 0, err
	}
	bs := int64(z.h.BlockSize)
	done := 0
	sp := z.scratch.Get().(*[]byte)
	defer z.scratch.Put(sp)
	for b := b0; b < b1 && done < len(p); b++ {
		enc := raw[z.offs[b]-z.offs[b0] : z.offs[b+1]-z.offs[b0]]
		if z.h.Verify {
			enc = enc[:len(enc)-blockCRCLen]
		}
		blen := min(bs, int64(z.h.OriginalFileSize)-int64(b)*bs)
		start := off + int64(done) - int64(b)*bs
		dst := *sp
		direct := start == 0 && int64(len(p)-done) >= blen
		if direct {
			dst = p[done:]
		}
		n, err := z.decode(enc, dst[:blen:blen])
		if err != nil || int64(n) != blen {
			return done, fmt.Errorf("%s: %w: block %d at offset %d decompresses to %d bytes, want %d: %v",
				z.name, ErrFormat, b, z.offs[b], n, blen, err)
		}
		if z.cache != nil {
			z.cache.add(z.cacheID, b, dst[:blen])
		}
		if direct {
			done += int(blen)
			continue
		}
		done += copy(p[done:], dst[start:blen])
	}
	return done, nil
}

func (z *Reader) checkBlocks(raw []byte, b0, b1 int) error {
	if !z.h.Verify {
		return nil
	}
	for b := b0; b < b1; b++ {
		enc := raw[z.offs[b]-z.offs[b0] : z.offs[b+1]-z.offs[b0]]
		data, crc := enc[:len(enc)-blockCRCLen], binary.LittleEndian.Uint32(enc[len(enc)-blockCRCLen:])
		if got := CRC32CSalt(data); got != crc {
			return fmt.Errorf("%s: %w: block %d at offset %d: crc %#08x, computed %#08x",
				z.name, ErrChecksum, b, z.offs[b], crc, got)
		}
	}
	return nil
}

func (z *Reader) decode(src, dst []byte) (int, error) {
	switch z.h.Algo {
	case AlgoLZ4:
		return lz4.UncompressBlock(src, dst)
	case AlgoZstd:
		out, err := z.zdec.DecodeAll(src, dst[:0])
		if err != nil {
			return 0, err
		}
		if len(out) > len(dst) || (len(out) > 0 && &out[0] != &dst[0]) {
			return len(out), errors.New("zstd frame larger than a block")
		}
		return len(out), nil
	}
	return 0, fmt.Errorf("unsupported algorithm %s", z.h.Algo)
}

// Verify checks every block's CRC and that it decompresses to its size.
func (z *Reader) Verify() error {
	buf := make([]byte, 1<<20)
	for off := int64(0); off < z.Size(); off += int64(len(buf)) {
		if _, err := z.ReadAt(buf, off); err != nil && err != io.EOF {
			return err
		}
	}
	return nil
}

// Close releases decoder resources and the reader's cached blocks.
func (z *Reader) Close() error {
	if z.cache != nil {
		z.cache.drop(z.cacheID)
	}
	if z.zdec != nil {
		z.zdec.Close()
	}
	return nil
}

func readFull(r io.ReaderAt, p []byte, off int64) error {
	n, err := r.ReadAt(p, off)
	if n == len(p) {
		return nil
	}
	if err == nil {
		err = io.ErrUnexpectedEOF
	}
	return err
}
