package zfile

import (
	"bufio"
	"encoding/binary"
	"fmt"
	"io"

	"github.com/klauspost/compress/zstd"
	"github.com/pierrec/lz4/v4"
)

// WriterOptions configure a ZFile writer.
type WriterOptions struct {
	Algo      Algorithm // default LZ4
	BlockSize uint32    // power of two in [4 KiB, 64 KiB]; default 4096
	NoVerify  bool      // omit per-block CRCs (upstream verify = 0)
}

// Writer compresses a stream into a ZFile, like upstream ZFileBuilder with
// verify = 1 and overwrite_header when the destination is an io.WriterAt.
type Writer struct {
	w     *bufio.Writer
	dst   io.Writer
	o     WriterOptions
	buf   []byte // pending raw bytes of the current block
	out   []byte
	lens  []uint32
	pos   uint64 // bytes written to w
	total uint64 // raw bytes consumed
	lz    lz4.CompressorCCompat
	zenc  *zstd.Encoder
	err   error
}

// NewWriter writes a ZFile header to w and returns a Writer for the
// uncompressed contents.
func NewWriter(w io.Writer, o WriterOptions) (*Writer, error) {
	if o.Algo == 0 {
		o.Algo = AlgoLZ4
	}
	if o.BlockSize == 0 {
		o.BlockSize = 4096
	}
	if o.BlockSize < minBlock || o.BlockSize > maxBlock || o.BlockSize&(o.BlockSize-1) != 0 {
		return nil, fmt.Errorf("zfile: block size %d not a power of two in [%d, %d]", o.BlockSize, minBlock, maxBlock)
	}
	zw := &Writer{w: bufio.NewWriterSize(w, 1<<20), dst: w, o: o, buf: make([]byte, 0, o.BlockSize)}
	switch o.Algo {
	case AlgoLZ4:
		zw.out = make([]byte, lz4.CompressBlockBound(int(o.BlockSize))+blockCRCLen)
	case AlgoZstd:
		var err error
		zw.zenc, err = zstd.NewWriter(nil, zstd.WithEncoderLevel(zstd.SpeedDefault), zstd.WithEncoderConcurrency(1))
		if err != nil {
			return nil, fmt.Errorf("zfile: zstd: %w", err)
		}
	default:
		return nil, fmt.Errorf("zfile: unsupported algorithm %s", o.Algo)
	}
	h := zw.header(FlagHeader | FlagData | FlagCalcDigest)
	if err := zw.emit(h.MarshalBinary()); err != nil {
		return nil, err
	}
	return zw, nil
}

func (zw *Writer) header(flags uint64) *Header {
	return &Header{Flags: flags, BlockSize: zw.o.BlockSize, Algo: zw.o.Algo, Verify: !zw.o.NoVerify}
}

func (zw *Writer) emit(b []byte) error {
	if zw.err != nil {
		return zw.err
	}
	n, err := zw.w.Write(b)
	zw.pos += uint64(n)
	if err != nil {
		zw.err = fmt.Errorf("zfile: write at %d: %w", zw.pos, err)
	}
	return zw.err
}

// Write consumes uncompressed bytes.
func (zw *Writer) Write(p []byte) (int, error) {
	done := 0
	for done < len(p) {
		k := min(len(p)-done, cap(zw.buf)-len(zw.buf))
		zw.buf = append(zw.buf, p[done:done+k]...)
		done += k
		if len(zw.buf) == cap(zw.buf) {
			if err := zw.flushBlock(); err != nil {
				return done, err
			}
		}
	}
	return done, nil
}

func (zw *Writer) flushBlock() error {
	if len(zw.buf) == 0 {
		return nil
	}
	var enc []byte
	switch zw.o.Algo {
	case AlgoLZ4:
		n, err := zw.lz.CompressBlock(zw.buf, zw.out)
		if err != nil || n == 0 {
			return fmt.Errorf("zfile: lz4 block %d: %v", len(zw.lens), err)
		}
		enc = zw.out[:n]
	case AlgoZstd:
		enc = zw.zenc.EncodeAll(zw.buf, zw.out[:0])
		zw.out = enc[:0]
	}
	if !zw.o.NoVerify {
		enc = binary.LittleEndian.AppendUint32(enc, CRC32CSalt(enc))
	}
	if err := zw.emit(enc); err != nil {
		return err
	}
	zw.lens = append(zw.lens, uint32(len(enc)))
	zw.total += uint64(len(zw.buf))
	zw.buf = zw.buf[:0]
	return nil
}

// Close writes the last block, the jump table and the trailer, and, when the
// destination is an io.WriterAt, rewrites the header with the final fields
// (HEADER_OVERWRITE). It does not close the destination.
func (zw *Writer) Close() error {
	if err := zw.flushBlock(); err != nil {
		return err
	}
	jt := make([]byte, 4*len(zw.lens))
	for i, l := range zw.lens {
		binary.LittleEndian.PutUint32(jt[4*i:], l)
	}
	h := zw.header(FlagData | FlagSealed | FlagCalcDigest)
	h.IndexOffset = zw.pos
	h.IndexSize = uint64(len(zw.lens))
	h.OriginalFileSize = zw.total
	h.IndexCRC = CRC32CRaw(jt)
	if err := zw.emit(jt); err != nil {
		return err
	}
	if err := zw.emit(h.MarshalBinary()); err != nil {
		return err
	}
	if err := zw.w.Flush(); err != nil {
		return fmt.Errorf("zfile: %w", err)
	}
	if wa, ok := zw.dst.(io.WriterAt); ok {
		h.Flags = FlagHeader | FlagData | FlagOverwrite | FlagCalcDigest
		if _, err := wa.WriteAt(h.MarshalBinary(), 0); err != nil {
			return fmt.Errorf("zfile: overwrite header: %w", err)
		}
	}
	if zw.zenc != nil {
		zw.zenc.Close()
	}
	return nil
}

// Size is the number of compressed bytes written so far.
func (zw *Writer) Size() int64 { return int64(zw.pos) }
