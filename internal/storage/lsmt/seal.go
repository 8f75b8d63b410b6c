package lsmt

import (
	"fmt"
	"log/slog"
	"os"
)

// SealInfo describes a layer sealed in place.
type SealInfo struct {
	Path string // the data file, now a sealed layer
	Size int64
	UUID string
	// Index is the index file SealUnsynced left behind (no longer needed), or "".
	Index string
}

// Seal turns the data file into a sealed layer in place (upstream
// close_seal): the layer's own index and a trailer are appended after the
// data, nothing is copied, and the index file is removed. The layer is closed
// afterwards. It costs O(index entries), not O(data).
func (l *RWLayer) Seal() (SealInfo, error) { return l.seal(true) }

// SealUnsynced is Seal without the fsync and without removing the index file: the
// sealed file's tail may still be only in the page cache, so the caller fsyncs it (by
// path) before anything durable refers to it, and removes SealInfo.Index. Both cost
// the host filesystem's journal (an unlink frees blocks and can wait for a journal
// commit: up to tens of ms on a busy host) and are kept out of a snapshot's frozen
// window this way.
func (l *RWLayer) SealUnsynced() (SealInfo, error) { return l.seal(false) }

func (l *RWLayer) seal(durable bool) (SealInfo, error) {
	if l.readOnly {
		return SealInfo{}, fmt.Errorf("%s: %w", l.name, ErrReadOnly)
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.closed {
		return SealInfo{}, fmt.Errorf("%s: %w", l.name, ErrClosed)
	}
	ms := l.index.Snapshot()
	e := l.eof
	buf := make([]byte, (len(ms)*entrySize+SectorSize-1)/SectorSize*SectorSize+HeaderSize)
	for i, m := range ms {
		m.Tag = 0
		EncodeMapping(buf[i*entrySize:], m)
	}
	t := *l.header
	t.Flags = FlagData | FlagSealed | l.header.Flags&(FlagSparseRW|FlagHybridRW)
	t.IndexOffset = uint64(e)
	t.IndexSize = uint64(len(ms))
	tb, err := t.MarshalBinary()
	if err != nil {
		return SealInfo{}, err
	}
	copy(buf[len(buf)-HeaderSize:], tb)
	end := e + int64(len(buf))
	// Only a torn tail makes the file longer than eof; a truncate to the same size
	// would still cost a journal handle on the host.
	if st, err := l.data.Stat(); err != nil || st.Size() != e {
		if err := l.data.Truncate(e); err != nil {
			return SealInfo{}, fmt.Errorf("%s: seal: %w", l.name, err)
		}
	}
	if _, err := l.data.WriteAt(buf, e); err != nil {
		return SealInfo{}, fmt.Errorf("%s: seal: write index at %d: %w", l.name, e, err)
	}
	if durable {
		if err := l.data.Sync(); err != nil {
			return SealInfo{}, fmt.Errorf("%s: seal: fsync: %w", l.name, err)
		}
	}
	l.closed = true
	l.data.Close()
	info := SealInfo{Path: l.dataPath, Size: end, UUID: l.header.UUID}
	if l.idx != nil {
		l.idx.Close()
		if !durable {
			info.Index = l.indexPath
		} else if err := os.Remove(l.indexPath); err != nil {
			slog.Warn("lsmt: remove index after seal", "index", l.indexPath, "err", err)
		}
	}
	return info, nil
}
