package rootfs

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/aenv-dev/aenv/internal/storage/blockdev"
	"github.com/aenv-dev/aenv/internal/storage/stack"
	"golang.org/x/sys/unix"
)

// Quiesce selects how Snapshot makes the filesystem consistent.
type Quiesce int

const (
	// QuiesceFreeze freezes the filesystem (FIFREEZE) around the seal: the sealed image
	// is clean (no journal to replay, fsck-clean) and holds every write that returned
	// before the freeze. Writes block for the freeze, the seal and the thaw: a few ms
	// (see Snapshot for what keeps that window short).
	QuiesceFreeze Quiesce = iota
	// QuiesceSync flushes the filesystem (syncfs) and then seals the device at a point
	// in time without freezing: the image is crash-consistent (the journal, replayed at
	// the next mount, covers writes racing the seal) and holds everything written before
	// the snapshot began. Writes block only while the stack swaps its upper.
	QuiesceSync
)

// SnapshotTimes are the phases of one Snapshot.
type SnapshotTimes struct {
	Sync   time.Duration // flushing dirty data while the root stays writable
	Frozen time.Duration // writes blocked: freeze, seal and restack, thaw
	// Freeze is the FIFREEZE call (the final flush and journal commit), Seal the
	// seal-and-restack, Thaw the FITHAW call: together Frozen.
	Freeze, Seal, Thaw time.Duration
	// Durable is making the sealed layer and the fresh upper durable on the host's
	// disk, after the thaw.
	Durable time.Duration
	Total   time.Duration
}

// Snapshot seals the root's current state into a new lower at output (which must not
// exist and must be on Dir's filesystem) while the filesystem stays mounted. It returns
// every lower of the snapshot, bottom first (the new one last), once they are durable.
//
// The time writes are blocked does not grow with what the root wrote:
//   - dirty data is flushed first (syncfs) with the root still writable, and little
//     is dirty at any time (MaxDirty; the flusher; the loop device's direct I/O, which
//     keeps a second copy out of the FUSE file's page cache), so the freeze only
//     commits what was written meanwhile and the journal;
//   - the flushes inside the window reach the stack without waiting for the host's
//     disk (Stack.HoldSync), and the seal makes nothing durable either: the sealed
//     layer is fsynced after the thaw (Stack.Persist), before this returns;
//   - RCU grace periods are expedited for the freeze (expediteRCU): freezing a
//     filesystem that was not frozen recently waits for three of them, ~30 ms here;
//   - a compaction the new depth calls for runs after the thaw.
//
// Writers racing the snapshot add what they dirtied during the syncfs to the freeze.
// Lowering the dirty limit for the snapshot would bound that, but a writer in a memory
// cgroup (every sandbox) then sits in a dirty-throttling pause of up to 200 ms inside
// its write, and the freeze waits for it: measured, it made the window 130-190 ms.
//
// A failure before the seal leaves the root as it was; one after it leaves the stack
// broken (stack.ErrBroken) and the root unusable.
func (b *Block) Snapshot(ctx context.Context, output string, q Quiesce) ([]stack.LayerRef, SnapshotTimes, error) {
	var t SnapshotTimes
	t0 := time.Now()
	// Until the thaw, flushes only move data into the host's page cache: what the seal
	// needs. Finish makes it durable afterwards with one fsync per file.
	snap, err := b.disk.BeginSnapshot(ctx)
	if err != nil {
		return nil, t, fmt.Errorf("rootfs: snapshot: %w", err)
	}
	defer snap.End()
	if err := syncfs(b.target); err != nil {
		return nil, t, err
	}
	// Waiting for a flusher fsync in progress belongs to the sync, not the window.
	if err := snap.Quiet(ctx); err != nil {
		return nil, t, fmt.Errorf("rootfs: snapshot: %w", err)
	}
	t1 := time.Now()
	t.Sync = t1.Sub(t0)
	thaw := func() error { return nil }
	if q == QuiesceFreeze {
		unexpedite := expediteRCU(b.dir)
		var err error
		thaw, err = blockdev.Freeze(b.target)
		unexpedite()
		if err != nil {
			return nil, t, fmt.Errorf("rootfs: %w", err)
		}
	}
	tf := time.Now()
	// The seal runs even when ctx is done: a frozen filesystem must not wait on it.
	_, serr := snap.Seal(context.WithoutCancel(ctx), output)
	ts := time.Now()
	terr := thaw()
	t2 := time.Now()
	t.Freeze, t.Seal, t.Thaw, t.Frozen = tf.Sub(t1), ts.Sub(tf), t2.Sub(ts), t2.Sub(t1)
	if serr != nil {
		t.Total = time.Since(t0)
		return nil, t, errors.Join(fmt.Errorf("rootfs: snapshot: %w", serr), terr)
	}
	lowers, durable, perr := snap.Finish(context.WithoutCancel(ctx))
	t.Durable = durable
	t.Total = time.Since(t0)
	if perr != nil {
		return nil, t, errors.Join(fmt.Errorf("rootfs: snapshot: %w", perr), terr)
	}
	if terr != nil {
		// The filesystem stays frozen: the root is of no use any more.
		return nil, t, fmt.Errorf("rootfs: %w", terr)
	}
	return lowers, t, nil
}

func syncfs(dir string) error {
	fd, err := unix.Open(dir, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("rootfs: open %s: %w", dir, err)
	}
	defer unix.Close(fd)
	if err := unix.Syncfs(fd); err != nil {
		return fmt.Errorf("rootfs: syncfs %s: %w", dir, err)
	}
	return nil
}
