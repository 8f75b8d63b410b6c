package stack

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"testing"
)

// TestRestackPersist runs the parts of SealAndRestack one by one, as a snapshot's
// frozen window does: Restack moves the sealed upper's index out of the way (the fresh
// upper takes its name) and Persist removes it; the sealed layer serves the data before
// and after, in this stack and in one opened from its manifest; a compaction, when the
// depth calls for it, runs only in CompactIfDeep.
func TestRestackPersist(t *testing.T) {
	ctx := context.Background()
	s, dir := newStack(t, 2)
	model := make([]byte, vsize)
	idx := filepath.Join(dir, "upper.index")
	for i := range 3 {
		p := bytes.Repeat([]byte{byte(i + 1)}, 64<<10)
		off := int64(i) * 32 << 10
		if _, err := s.WriteAt(p, off); err != nil {
			t.Fatal(err)
		}
		copy(model[off:], p)
		out := filepath.Join(dir, "l"+string(rune('0'+i)))
		ref, err := s.Restack(ctx, out)
		if err != nil {
			t.Fatal(err)
		}
		if ref.Path != out {
			t.Fatalf("ref %+v", ref)
		}
		if _, err := os.Stat(sealedIndex(idx)); err != nil {
			t.Fatalf("sealed index before Persist: %v", err)
		}
		for _, p := range []string{out, idx, filepath.Join(dir, "upper.data")} {
			if _, err := os.Stat(p); err != nil {
				t.Fatal(err)
			}
		}
		compare(t, s, model, i)
		if err := s.Persist(ref); err != nil {
			t.Fatal(err)
		}
		if _, err := os.Stat(sealedIndex(idx)); !os.IsNotExist(err) {
			t.Fatalf("sealed index after Persist: %v", err)
		}
		if s.Depth() != i+1 {
			t.Fatalf("depth %d after %d restacks (Restack must not compact)", s.Depth(), i+1)
		}
	}
	cref, err := s.CompactIfDeep(ctx, filepath.Join(dir, "l2"))
	if err != nil {
		t.Fatal(err)
	}
	if cref.Path == "" || s.Depth() != 2 {
		t.Fatalf("compaction %+v, depth %d", cref, s.Depth())
	}
	if ref, err := s.CompactIfDeep(ctx, filepath.Join(dir, "l3")); err != nil || ref.Path != "" {
		t.Fatalf("second compaction at depth 2: %+v %v", ref, err)
	}
	compare(t, s, model, 10)
	m := s.Manifest()
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	// A crash between Restack and Persist leaves the sealed index; Open removes it.
	if err := os.WriteFile(sealedIndex(idx), []byte("stale"), 0o644); err != nil {
		t.Fatal(err)
	}
	s2, err := Open(ctx, &m, Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer s2.Close()
	compare(t, s2, model, 11)
	if _, err := os.Stat(sealedIndex(idx)); !os.IsNotExist(err) {
		t.Fatalf("stale sealed index after Open: %v", err)
	}
}

// TestHoldSync checks that a held Sync still hands every completed write to the files
// (a reopen sees it, as after the process dying) and that holds nest and release once.
func TestHoldSync(t *testing.T) {
	ctx := context.Background()
	s, dir := newStack(t, 0)
	r1 := s.HoldSync()
	r2 := s.HoldSync()
	p := bytes.Repeat([]byte{9}, 4096)
	if _, err := s.WriteAt(p, 8192); err != nil {
		t.Fatal(err)
	}
	idx := filepath.Join(dir, "upper.index")
	before, err := os.Stat(idx)
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Sync(); err != nil {
		t.Fatal(err)
	}
	after, err := os.Stat(idx)
	if err != nil {
		t.Fatal(err)
	}
	if after.Size() <= before.Size() {
		t.Fatalf("held Sync left the index entry buffered (%d -> %d bytes)", before.Size(), after.Size())
	}
	r1()
	r1() // releases once
	if s.syncHeld.Load() != 1 {
		t.Fatalf("holds %d after one of two released", s.syncHeld.Load())
	}
	r2()
	if s.syncHeld.Load() != 0 {
		t.Fatalf("holds %d after both released", s.syncHeld.Load())
	}
	if err := s.Sync(); err != nil {
		t.Fatal(err)
	}
	if err := s.StartWriteback(); err != nil {
		t.Fatal(err)
	}
	m := s.Manifest()
	s.Close()
	if err := s.StartWriteback(); err == nil {
		t.Fatal("StartWriteback on a closed stack")
	}
	s2, err := Open(ctx, &m, Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer s2.Close()
	got := make([]byte, 4096)
	if _, err := s2.ReadAt(got, 8192); err != nil || !bytes.Equal(got, p) {
		t.Fatalf("reopened: %v", err)
	}
}

// TestSyncBeforePersist checks that a Sync between a Restack and its Persist (a guest's
// flush after a snapshot's hold ended, while its Persist still runs) makes the sealed
// layer and the renames durable before it answers, once, and that a failure to do so
// is reported.
func TestSyncBeforePersist(t *testing.T) {
	ctx := context.Background()
	for _, tc := range []struct {
		name    string
		fail    bool
		persist bool // Persist runs before the Sync
	}{
		{name: "sync first"},
		{name: "persist first", persist: true},
		{name: "fsync fails", fail: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s, dir := newStack(t, 1)
			var synced []string
			s.syncPath = func(p string) error {
				synced = append(synced, p)
				if tc.fail {
					return os.ErrPermission
				}
				return fsyncPath(p)
			}
			if _, err := s.WriteAt(bytes.Repeat([]byte{7}, 4096), 0); err != nil {
				t.Fatal(err)
			}
			release := s.HoldSync()
			out := filepath.Join(dir, "sealed")
			ref, err := s.Restack(ctx, out)
			if err != nil {
				t.Fatal(err)
			}
			release()
			if tc.persist {
				if err := s.Persist(ref); err != nil {
					t.Fatal(err)
				}
				synced = nil
			}
			if _, err := s.WriteAt(bytes.Repeat([]byte{8}, 4096), 4096); err != nil {
				t.Fatal(err)
			}
			err = s.Sync()
			if tc.fail {
				if err == nil {
					t.Fatal("Sync answered success though the sealed layer could not be made durable")
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			has := func(p string) bool {
				for _, q := range synced {
					if q == p {
						return true
					}
				}
				return false
			}
			if has(out) == tc.persist || has(dir) == tc.persist {
				t.Fatalf("persisted first %v, the Sync fsynced %v", tc.persist, synced)
			}
			synced = nil
			if err := s.Sync(); err != nil {
				t.Fatal(err)
			}
			if has(out) {
				t.Fatalf("a second Sync fsynced the sealed layer again: %v", synced)
			}
			if !tc.persist {
				if err := s.Persist(ref); err != nil {
					t.Fatal(err)
				}
			}
		})
	}
}
