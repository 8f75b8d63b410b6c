package main

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"github.com/spf13/cobra"

	"github.com/aenv-dev/aenv/internal/storage/blob"
	"github.com/aenv-dev/aenv/internal/storage/lsmt"
	"github.com/aenv-dev/aenv/internal/storage/stack"
	"github.com/aenv-dev/aenv/internal/storage/tarwrap"
	"github.com/aenv-dev/aenv/internal/storage/zfile"
)

// newLayerCmd is `aenv layer`: overlaybd-compatible layer tools, mirroring
// overlaybd-create/-commit and friends. Errors go to stderr with a non-zero
// exit; data and results go to stdout.
func newLayerCmd() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "layer",
		Short: "Create, import, commit, inspect and read overlaybd (LSMT/ZFile) layers",
	}
	cmd.AddCommand(layerCreateCmd(), layerImportCmd(), layerCommitCmd(), layerInspectCmd(), layerCatCmd())
	return cmd
}

func layerCreateCmd() *cobra.Command {
	var size, index, parent, tag string
	var sparse, hybrid bool
	c := &cobra.Command{
		Use:   "create OUT --size N",
		Short: "Create an empty writable layer (OUT data file plus OUT.index)",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			vs, err := parseSize(size)
			if err != nil {
				return err
			}
			if index == "" && !sparse {
				index = indexPathFor(args[0])
			}
			l, err := lsmt.CreateRW(args[0], index, lsmt.CreateOptions{VirtualSize: vs, ParentUUID: parent, UserTag: tag, Sparse: sparse, Hybrid: hybrid})
			if err != nil {
				return err
			}
			h := l.Header()
			if err := l.Close(); err != nil {
				return err
			}
			fmt.Fprintln(cmd.OutOrStdout(), h.UUID)
			return nil
		},
	}
	c.Flags().StringVar(&size, "size", "", "virtual size in bytes (suffixes K, M, G, T; multiple of 512)")
	c.Flags().StringVar(&index, "index", "", "index file path (default OUT.index, or OUT with .data replaced by .index)")
	c.Flags().StringVar(&parent, "parent", "", "parent layer uuid")
	c.Flags().StringVarP(&tag, "message", "m", "", "user tag")
	c.Flags().BoolVarP(&sparse, "sparse", "s", false, "one sparse file, no index file")
	c.Flags().BoolVar(&hybrid, "hybrid", false, "overwrite data the layer already holds in place (AgentENV hybrid upper)")
	_ = c.MarkFlagRequired("size")
	return c
}

func layerImportCmd() *cobra.Command {
	var algo, parent, tag string
	var tarWrap bool
	c := &cobra.Command{
		Use:   "import RAW OUT",
		Short: "Convert a raw disk image into one sealed layer (holes stay holes); prints digest and size",
		Args:  cobra.ExactArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			raw, err := os.Open(args[0])
			if err != nil {
				return err
			}
			defer raw.Close()
			return writeLayer(cmd, args[1], algo, tarWrap, func(w io.Writer) error {
				_, err := lsmt.Import(w, raw, lsmt.CommitOptions{ParentUUID: parent, UserTag: tag})
				return err
			})
		},
	}
	c.Flags().StringVarP(&algo, "compress", "z", "", "wrap in a ZFile: lz4 or zstd")
	c.Flags().StringVarP(&parent, "parent", "p", "", "parent layer uuid")
	c.Flags().StringVarP(&tag, "message", "m", "", "user tag")
	c.Flags().BoolVarP(&tarWrap, "tar", "t", false, "add the tar wrapper registries serve")
	return c
}

func layerCommitCmd() *cobra.Command {
	var algo, index, parent, tag string
	var seal, tarWrap bool
	c := &cobra.Command{
		Use:   "commit RW OUT",
		Short: "Compact a writable layer into a sealed layer (or --seal it in place and move it to OUT)",
		Args:  cobra.ExactArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			if index == "" {
				index = indexPathFor(args[0])
			}
			if _, err := os.Lstat(args[1]); err == nil {
				return fmt.Errorf("%s already exists", args[1])
			}
			l, err := lsmt.OpenRWWith(args[0], index, lsmt.OpenOptions{ReadOnly: !seal})
			if err != nil {
				return err
			}
			if seal {
				return sealTo(cmd, l, args[1], algo, tarWrap)
			}
			defer l.Close()
			h := l.Header()
			if parent == "" {
				parent = h.ParentUUID
			}
			return writeLayer(cmd, args[1], algo, tarWrap, func(w io.Writer) error {
				ms := l.Mappings()
				_, err := lsmt.Commit(w, lsmt.CommitSource{Mappings: ms, VirtualSize: h.VirtualSize,
					Read: func(_ uint8, p []byte, off int64) error { return l.ReadPhysical(p, off) }},
					lsmt.CommitOptions{ParentUUID: parent, UserTag: tag})
				return err
			})
		},
	}
	c.Flags().StringVarP(&algo, "compress", "z", "", "wrap in a ZFile: lz4 or zstd")
	c.Flags().StringVar(&index, "index", "", "index file (default RW.index, or RW with .data replaced by .index)")
	c.Flags().StringVarP(&parent, "parent", "p", "", "parent uuid (default: the RW layer's parent)")
	c.Flags().StringVarP(&tag, "message", "m", "", "user tag")
	c.Flags().BoolVar(&seal, "seal", false, "seal in place (no data copy; garbage kept) and rename RW to OUT")
	c.Flags().BoolVarP(&tarWrap, "tar", "t", false, "add the tar wrapper registries serve")
	return c
}

// sealTo seals l in place and moves it to out, compressing into out when
// algo is set (the sealed source is then removed).
func sealTo(cmd *cobra.Command, l *lsmt.RWLayer, out, algo string, tarWrap bool) error {
	info, err := l.Seal()
	if err != nil {
		return err
	}
	if algo == "" && !tarWrap {
		if err := os.Rename(info.Path, out); err != nil {
			return err
		}
		return printDigest(cmd, out)
	}
	src, err := os.Open(info.Path)
	if err != nil {
		return err
	}
	defer src.Close()
	err = writeLayer(cmd, out, algo, tarWrap, func(w io.Writer) error {
		_, err := io.Copy(w, src)
		return err
	})
	if err == nil {
		err = os.Remove(info.Path)
	}
	return err
}

// writeLayer writes a layer to out through an optional ZFile and tar
// wrapper, via a temporary file renamed into place, and prints
// "sha256:<hex> <size>".
func writeLayer(cmd *cobra.Command, out, algo string, tarWrap bool, fill func(io.Writer) error) error {
	var opts zfile.WriterOptions
	if algo != "" {
		a, err := zfile.ParseAlgorithm(algo)
		if err != nil {
			return err
		}
		opts.Algo = a
	}
	if _, err := os.Lstat(out); err == nil {
		return fmt.Errorf("%s already exists", out)
	}
	tmp, err := os.CreateTemp(filepath.Dir(out), "."+filepath.Base(out)+".tmp*")
	if err != nil {
		return err
	}
	defer os.Remove(tmp.Name())
	defer tmp.Close()
	var w io.Writer = tmp
	var zw *zfile.Writer
	if algo != "" {
		if zw, err = zfile.NewWriter(tmp, opts); err != nil {
			return err
		}
		w = zw
	}
	if err := fill(w); err != nil {
		return err
	}
	if zw != nil {
		if err := zw.Close(); err != nil {
			return err
		}
	}
	final := tmp
	if tarWrap {
		if final, err = wrapTar(tmp, out); err != nil {
			return err
		}
		defer os.Remove(final.Name())
		defer final.Close()
	}
	if err := final.Sync(); err != nil {
		return err
	}
	if err := os.Rename(final.Name(), out); err != nil {
		return err
	}
	return printDigest(cmd, out)
}

// wrapTar copies src into a new temporary file inside the tar wrapper.
func wrapTar(src *os.File, out string) (*os.File, error) {
	st, err := src.Stat()
	if err != nil {
		return nil, err
	}
	if _, err := src.Seek(0, io.SeekStart); err != nil {
		return nil, err
	}
	dst, err := os.CreateTemp(filepath.Dir(out), "."+filepath.Base(out)+".tar*")
	if err != nil {
		return nil, err
	}
	if err := tarwrap.Wrap(dst, src, st.Size()); err != nil {
		dst.Close()
		os.Remove(dst.Name())
		return nil, err
	}
	return dst, nil
}

func printDigest(cmd *cobra.Command, path string) error {
	f, err := os.Open(path)
	if err != nil {
		return err
	}
	defer f.Close()
	h := sha256.New()
	n, err := io.Copy(h, f)
	if err != nil {
		return err
	}
	fmt.Fprintf(cmd.OutOrStdout(), "sha256:%s %d\n", hex.EncodeToString(h.Sum(nil)), n)
	return nil
}

// layerInfo is inspect's JSON output.
type layerInfo struct {
	File        string          `json:"file"`
	Size        int64           `json:"size"`
	Kind        string          `json:"kind"` // sealed | rw
	Tar         any             `json:"tar,omitempty"`
	ZFile       *zfileInfo      `json:"zfile,omitempty"`
	Header      lsmt.Header     `json:"header"`
	Trailer     *lsmt.Header    `json:"trailer,omitempty"`
	VirtualSize uint64          `json:"virtual_size"`
	Entries     int             `json:"entries"`
	Padding     int             `json:"padding_entries"`
	Index       []indexEntryOut `json:"index,omitempty"`
	// Torn lists index entries whose data never reached the data file (a crash
	// before sync); a writable open drops them.
	Torn []int `json:"torn_entries,omitempty"`
}

type zfileInfo struct {
	Header    zfile.Header `json:"header"`
	Trailer   zfile.Header `json:"trailer"`
	Algorithm string       `json:"algorithm"`
	CRC       string       `json:"crc_check"` // "ok" or the error
}

type indexEntryOut struct {
	Offset  uint64 `json:"offset"`
	Length  uint32 `json:"length"`
	MOffset uint64 `json:"moffset"`
	Zeroed  bool   `json:"zeroed,omitempty"`
}

func layerInspectCmd() *cobra.Command {
	var output, index string
	c := &cobra.Command{
		Use:   "inspect FILE",
		Short: "Show header fields, flags, index entries, virtual size and CRC check (tar-wrapped blobs accepted)",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			info, err := inspect(args[0], index)
			if err != nil {
				return err
			}
			w := cmd.OutOrStdout()
			switch output {
			case "json":
				if err := encodeIndented(w, info); err != nil {
					return err
				}
			case "", "text":
				printInfo(w, info)
			default:
				return fmt.Errorf("unknown output format %q (want text or json)", output)
			}
			if info.ZFile != nil && info.ZFile.CRC != "ok" {
				return fmt.Errorf("%s: CRC check failed: %s", args[0], info.ZFile.CRC)
			}
			return nil
		},
	}
	c.Flags().StringVarP(&output, "output", "o", "text", "output format: text or json")
	c.Flags().StringVar(&index, "index", "", "index file, for writable layers (default FILE.index)")
	return c
}

func inspect(path, index string) (*layerInfo, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return nil, err
	}
	info := &layerInfo{File: path, Size: st.Size()}
	l, err := blob.Open(f, st.Size(), path)
	if err != nil {
		// Not sealed: maybe a writable data file.
		if index == "" {
			index = indexPathFor(path)
		}
		rw, rerr := lsmt.OpenRWWith(path, index, lsmt.OpenOptions{ReadOnly: true})
		if rerr != nil {
			if errors.Is(rerr, os.ErrNotExist) {
				return nil, err
			}
			return nil, fmt.Errorf("%w (as a writable layer: %w)", err, rerr)
		}
		defer rw.Close()
		info.Kind = "rw"
		info.Torn = rw.TornEntries()
		info.Header = rw.Header()
		info.VirtualSize = info.Header.VirtualSize
		ms := rw.Mappings()
		info.Entries = len(ms)
		info.Index = entriesOut(ms)
		return info, nil
	}
	defer l.Close()
	info.Kind = "sealed"
	if l.Tar != nil {
		info.Tar = l.Tar
	}
	if l.ZFile != nil {
		zi := &zfileInfo{Header: l.ZFile.Header(), Trailer: l.ZFile.Trailer(), Algorithm: l.ZFile.Trailer().Algo.String(), CRC: "ok"}
		if rt, ok := l.ZFile.RawTrailer(); ok {
			zi.Trailer = rt
		}
		if err := l.ZFile.Verify(); err != nil {
			zi.CRC = err.Error()
		}
		info.ZFile = zi
	}
	info.Header = l.Header()
	t := l.Trailer()
	info.Trailer = &t
	info.VirtualSize = l.VirtualSize()
	info.Entries = l.Index().Len()
	info.Padding = l.PaddingEntries()
	info.Index = entriesOut(l.Index().Mappings())
	return info, nil
}

func entriesOut(ms []lsmt.Mapping) []indexEntryOut {
	out := make([]indexEntryOut, len(ms))
	for i, m := range ms {
		out[i] = indexEntryOut{Offset: m.Offset, Length: m.Length, MOffset: m.MOffset, Zeroed: m.Zeroed}
	}
	return out
}

func printInfo(w io.Writer, info *layerInfo) {
	fmt.Fprintf(w, "file:          %s (%d bytes, %s)\n", info.File, info.Size, info.Kind)
	if info.Tar != nil {
		b, _ := json.Marshal(info.Tar)
		fmt.Fprintf(w, "tar:           %s\n", b)
	}
	if z := info.ZFile; z != nil {
		fmt.Fprintf(w, "zfile:         algo %s, block %d, blocks %d, original %d, header flags %#x, trailer flags %#x, crc %s\n",
			z.Algorithm, z.Trailer.BlockSize, z.Trailer.IndexSize, z.Trailer.OriginalFileSize, z.Header.Flags, z.Trailer.Flags, z.CRC)
	}
	h := info.Header
	fmt.Fprintf(w, "header:        flags %#x, index_offset %d, index_size %d, version %d.%d\n", h.Flags, h.IndexOffset, h.IndexSize, h.Version, h.SubVersion)
	if t := info.Trailer; t != nil {
		fmt.Fprintf(w, "trailer:       flags %#x, index_offset %d, index_size %d\n", t.Flags, t.IndexOffset, t.IndexSize)
		h = *t
	}
	fmt.Fprintf(w, "uuid:          %s\nparent:        %s\nuser_tag:      %q\n", orNone(h.UUID), orNone(h.ParentUUID), h.UserTag)
	fmt.Fprintf(w, "virtual_size:  %d\nentries:       %d valid, %d padding\n", info.VirtualSize, info.Entries, info.Padding)
	if len(info.Torn) > 0 {
		fmt.Fprintf(w, "torn:          %d entries point past the data file (never synced), numbers %v; a writable open drops them\n", len(info.Torn), info.Torn)
	}
	for _, e := range info.Index {
		z := ""
		if e.Zeroed {
			z = " zeroed"
		}
		fmt.Fprintf(w, "  %d+%d -> %d%s\n", e.Offset, e.Length, e.MOffset, z)
	}
}

func orNone(s string) string {
	if s == "" {
		return "none"
	}
	return s
}

// virtualReader is what cat reads from: a layer or a stack.
type virtualReader interface {
	ReadAt(p []byte, off int64) (int, error)
}

func layerCatCmd() *cobra.Command {
	var offset, length string
	c := &cobra.Command{
		Use:   "cat FILE|STACK.json",
		Short: "Write the virtual disk's bytes to stdout",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			off, err := parseSize(offset)
			if err != nil {
				return fmt.Errorf("--offset: %w", err)
			}
			r, vsize, closeFn, err := openForCat(cmd.Context(), args[0])
			if err != nil {
				return err
			}
			defer closeFn()
			n := vsize - min(off, vsize)
			if length != "" {
				l, err := parseSize(length)
				if err != nil {
					return fmt.Errorf("--length: %w", err)
				}
				if off+l > vsize {
					return fmt.Errorf("range [%d, %d) beyond virtual size %d", off, off+l, vsize)
				}
				n = l
			}
			return catRange(cmd.Context(), newCatWriter(cmd.OutOrStdout()), r, off, n)
		},
	}
	c.Flags().StringVar(&offset, "offset", "0", "start offset in bytes")
	c.Flags().StringVar(&length, "length", "", "number of bytes (default: to the end)")
	return c
}

func openForCat(ctx context.Context, path string) (virtualReader, uint64, func(), error) {
	if ctx == nil {
		ctx = context.Background()
	}
	if strings.HasSuffix(path, ".json") {
		m, err := stack.LoadManifest(path)
		if err != nil {
			return nil, 0, nil, err
		}
		// Reading must change nothing: no upper is created, an existing one is
		// opened read-only.
		s, err := stack.Open(ctx, m, stack.Options{ReadOnly: true})
		if err != nil {
			return nil, 0, nil, err
		}
		return s, uint64(s.Size()), func() { s.Close() }, nil
	}
	f, err := os.Open(path)
	if err != nil {
		return nil, 0, nil, err
	}
	st, err := f.Stat()
	if err != nil {
		f.Close()
		return nil, 0, nil, err
	}
	l, err := blob.Open(f, st.Size(), path)
	if err != nil {
		f.Close()
		return nil, 0, nil, err
	}
	return &sectorReader{l.Layer}, l.VirtualSize(), func() { l.Close(); f.Close() }, nil
}

// sectorReader lets cat read a single layer at any offset and length.
type sectorReader struct{ l *lsmt.Layer }

func (s *sectorReader) ReadAt(p []byte, off int64) (int, error) {
	a := off &^ (lsmt.SectorSize - 1)
	e := (off + int64(len(p)) + lsmt.SectorSize - 1) &^ (lsmt.SectorSize - 1)
	if a == off && e == off+int64(len(p)) {
		return s.l.ReadAt(p, off)
	}
	buf := make([]byte, e-a)
	n, err := s.l.ReadAt(buf, a)
	c := 0
	if int64(n) > off-a {
		c = copy(p, buf[off-a:n])
	}
	return c, err
}

func indexPathFor(data string) string {
	if strings.HasSuffix(data, ".data") {
		return strings.TrimSuffix(data, ".data") + ".index"
	}
	return data + ".index"
}

// parseSize parses a byte count with an optional K/M/G/T suffix (powers of 1024).
func parseSize(s string) (uint64, error) {
	s = strings.TrimSpace(s)
	mult := uint64(1)
	if n := len(s); n > 0 {
		switch strings.ToUpper(s[n-1:]) {
		case "K":
			mult = 1 << 10
		case "M":
			mult = 1 << 20
		case "G":
			mult = 1 << 30
		case "T":
			mult = 1 << 40
		}
		if mult != 1 {
			s = s[:n-1]
		}
	}
	v, err := strconv.ParseUint(s, 10, 64)
	if err != nil {
		return 0, fmt.Errorf("bad size %q", s)
	}
	if v > (1<<63)/mult {
		return 0, fmt.Errorf("size %q too large", s)
	}
	return v * mult, nil
}
