package posixfs

import (
	"context"
	"encoding/json"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/aenv-dev/aenv/internal/repository"
	"github.com/aenv-dev/aenv/internal/repository/repositorytest"
)

// deadPID returns the pid of a process that has exited.
func deadPID(t *testing.T) int {
	cmd := exec.Command("true")
	if err := cmd.Run(); err != nil {
		t.Skipf("cannot run true: %v", err)
	}
	return cmd.Process.Pid
}

func TestLockTakeover(t *testing.T) {
	host, _ := os.Hostname()
	for _, tc := range []struct {
		name      string
		owner     lockOwner
		age       time.Duration
		garbage   bool
		wantTaken bool
	}{
		{"dead process on this host", lockOwner{Host: host, Token: "t"}, 0, false, true},
		{"other host, older than stale age", lockOwner{Host: "other-node", PID: 1, Token: "t"}, 2 * time.Minute, false, true},
		{"garbage, older than stale age", lockOwner{}, 2 * time.Minute, true, true},
		{"other host, fresh", lockOwner{Host: "other-node", PID: 1, Token: "t"}, 0, false, false},
		{"live process on this host", lockOwner{Host: host, PID: 1, Token: "t"}, 0, false, false},
		{"garbage, fresh (holder still writing)", lockOwner{}, 0, true, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r, err := Open(t.TempDir(), Options{LockTimeout: 300 * time.Millisecond})
			if err != nil {
				t.Fatal(err)
			}
			if tc.owner.Host == host && tc.owner.PID == 0 {
				tc.owner.PID = deadPID(t)
			}
			lock := filepath.Join(r.Root(), "records", "template", "x.lock")
			b, _ := json.Marshal(tc.owner)
			if tc.garbage {
				b = []byte("{not json")
			}
			if err := os.WriteFile(lock, b, 0o644); err != nil {
				t.Fatal(err)
			}
			old := time.Now().Add(-tc.age)
			if err := os.Chtimes(lock, old, old); err != nil {
				t.Fatal(err)
			}
			_, err = r.PutRecord(context.Background(), repositorytest.Record(repository.KindTemplate, "x"))
			if tc.wantTaken {
				if err != nil {
					t.Fatalf("stale lock not taken over: %v", err)
				}
				if _, err := os.Stat(lock); !errors.Is(err, os.ErrNotExist) {
					t.Fatalf("lock file left after the write: %v", err)
				}
				return
			}
			if !errors.Is(err, repository.ErrLocked) {
				t.Fatalf("live lock: err = %v, want ErrLocked", err)
			}
			if _, err := r.GetRecord(context.Background(), repository.KindTemplate, "x"); !errors.Is(err, repository.ErrNotFound) {
				t.Fatalf("record written despite the lock: %v", err)
			}
			if got, _ := os.ReadFile(lock); string(got) != string(b) {
				t.Fatal("live lock was modified")
			}
		})
	}
}

// Two handles on one directory behave as two nodes sharing an NFS export:
// their record updates serialize and no update is lost.
func TestTwoNodesShareDirectory(t *testing.T) {
	dir := t.TempDir()
	a, err := Open(dir, Options{})
	if err != nil {
		t.Fatal(err)
	}
	b, err := Open(dir, Options{})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	if _, err := a.PutRecord(ctx, repositorytest.Record(repository.KindSnapshot, "shared")); err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	errs := make(chan error, 2)
	for _, r := range []*Repo{a, b} {
		wg.Go(func() {
			for range 10 {
				for {
					cur, err := r.GetRecord(ctx, repository.KindSnapshot, "shared")
					if err != nil {
						errs <- err
						return
					}
					cur.Layers = append(cur.Layers, repository.Layer{Role: "rootfs", Digest: repository.DigestOf([]byte(time.Now().String())), Size: 1})
					if _, err = r.PutRecord(ctx, cur); err == nil {
						break
					} else if !errors.Is(err, repository.ErrConflict) {
						errs <- err
						return
					}
				}
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	final, err := b.GetRecord(ctx, repository.KindSnapshot, "shared")
	if err != nil || len(final.Layers) != 20 || final.Revision != 21 {
		t.Fatalf("final record has %d layers, revision %d (err %v); want 20 and 21", len(final.Layers), final.Revision, err)
	}
}

func TestOpenCleansStaleTmpAndChecksLayout(t *testing.T) {
	dir := t.TempDir()
	if _, err := Open(dir, Options{}); err != nil {
		t.Fatal(err)
	}
	stale := filepath.Join(dir, "tmp", "blob-old")
	fresh := filepath.Join(dir, "tmp", "blob-inflight")
	for _, p := range []string{stale, fresh} {
		if err := os.WriteFile(p, []byte("partial"), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	old := time.Now().Add(-2 * time.Hour)
	if err := os.Chtimes(stale, old, old); err != nil {
		t.Fatal(err)
	}
	if _, err := Open(dir, Options{}); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(stale); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("stale temp file kept: %v", err)
	}
	if _, err := os.Stat(fresh); err != nil {
		t.Fatalf("another writer's in-flight temp file removed: %v", err)
	}
	// A blob a crashed GC had moved aside comes back.
	blob, d := repositorytest.Blob(3, 100)
	aside := filepath.Join(dir, "tmp", "gc-"+d.Hex()+"-deadbeef")
	if err := os.WriteFile(aside, blob, 0o444); err != nil {
		t.Fatal(err)
	}
	r, err := Open(dir, Options{})
	if err != nil {
		t.Fatal(err)
	}
	if got, err := repository.ReadAll(context.Background(), r, d); err != nil || string(got) != string(blob) {
		t.Fatalf("blob moved aside by a crashed GC not restored: %v", err)
	}
	if _, err := os.Stat(aside); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("GC leftover kept: %v", err)
	}
	if err := os.WriteFile(filepath.Join(dir, layoutFile), []byte(`{"layout": 9}`), 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := Open(dir, Options{}); !errors.Is(err, repository.ErrInvalid) {
		t.Fatalf("unknown layout: %v, want ErrInvalid", err)
	}
}

// A record file damaged on disk is reported, not silently skipped: GC must
// not run without knowing every reference.
func TestCorruptRecordIsAnError(t *testing.T) {
	r, err := Open(t.TempDir(), Options{})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	if _, err := r.PutRecord(ctx, repositorytest.Record(repository.KindSnapshot, "ok")); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(r.Root(), "records", "snapshot", "bad.json"), []byte("{"), 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := r.ListRecords(ctx, repository.KindSnapshot, repository.ListOptions{}); !errors.Is(err, repository.ErrInvalid) {
		t.Fatalf("list with a corrupt record: %v, want ErrInvalid", err)
	}
	if _, err := repository.GC(ctx, r, repository.GCOptions{Grace: -1}); err == nil {
		t.Fatal("GC ran over a corrupt record")
	}
}
