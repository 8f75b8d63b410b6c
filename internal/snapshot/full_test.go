package snapshot

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"testing"

	"github.com/aenv-dev/aenv/internal/repository"
	"github.com/aenv-dev/aenv/internal/repository/posixfs"
)

// A posix_fs repository on a filesystem that fills up in the middle of a publication
// (a small tmpfs): the upload fails with ENOSPC after its retries, the journal stays,
// the record stays pending (no other node syncs it), the repository holds no partial
// blob and no temporary file; once space is freed Resume completes the publication and
// the other node syncs it.
func TestPosixRepositoryFullMidPublish(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root: mounts a small tmpfs as the repository")
	}
	ctx := context.Background()
	dir := t.TempDir()
	mnt := filepath.Join(dir, "repo")
	if err := os.Mkdir(mnt, 0o755); err != nil {
		t.Fatal(err)
	}
	// Room for the repository's directories and records, not for the layers.
	if out, err := exec.Command("mount", "-t", "tmpfs", "-o", "size=96k", "tmpfs", mnt).CombinedOutput(); err != nil {
		t.Skipf("cannot mount a tmpfs: %v: %s", err, out)
	}
	t.Cleanup(func() { _ = exec.Command("umount", "-l", mnt).Run() })
	remote, err := posixfs.Open(mnt, posixfs.Options{})
	if err != nil {
		t.Fatal(err)
	}
	a := newNode(t, "node-a", remote, Options{MaxAttempts: 2})
	b := newNode(t, "node-b", remote, Options{})
	files, _ := stackLayers(t, t.TempDir(), 3, 77)
	var total int64
	for _, f := range files {
		st, err := os.Stat(f.Path)
		if err != nil {
			t.Fatal(err)
		}
		total += st.Size()
	}
	if total < 96<<10 {
		t.Fatalf("layers total %d bytes; the test needs more than the repository holds", total)
	}
	const id = "snap-full"
	h, err := a.pub.Publish(ctx, testManifest(t, id, files))
	if err != nil {
		t.Fatal(err)
	}
	if err := h.Wait(ctx); err == nil || h.Status().State != StateFailed {
		t.Fatalf("publication into a full repository: %v (%+v)", err, h.Status())
	}
	t.Logf("publication into a full repository failed with: %v", h.Status().Err)
	if !a.pub.journaled(id) {
		t.Fatal("a full repository dropped the journal: the publication could never finish")
	}
	if rec, err := remote.GetRecord(ctx, repository.KindSnapshot, id); err == nil && rec.State != repository.StatePending {
		t.Fatalf("record after the failure is %s", rec.State)
	}
	if res, err := b.pub.Sync(ctx); err != nil || slices.Contains(res.Added, id) {
		t.Fatalf("another node synced a publication that failed on a full repository: %+v %v", res, err)
	}
	requireNoPartialBlobs(ctx, t, remote, mnt)

	if out, err := exec.Command("mount", "-o", "remount,size=64m", mnt).CombinedOutput(); err != nil {
		t.Fatalf("grow the tmpfs: %v: %s", err, out)
	}
	hs, err := a.pub.Resume(ctx)
	if err != nil || len(hs) != 1 {
		t.Fatalf("Resume = %d handles, %v", len(hs), err)
	}
	if err := hs[0].Wait(ctx); err != nil {
		t.Fatalf("publication once space was freed: %v", err)
	}
	rec, err := remote.GetRecord(ctx, repository.KindSnapshot, id)
	if err != nil || rec.State != repository.StateComplete || len(rec.Layers) != len(files) {
		t.Fatalf("record after resume: %+v %v", rec, err)
	}
	if res, err := b.pub.Sync(ctx); err != nil || !slices.Contains(res.Added, id) {
		t.Fatalf("sync after the publication completed: %+v %v", res, err)
	}
	requireNoPartialBlobs(ctx, t, remote, mnt)
}

// requireNoPartialBlobs checks that every blob of the repository has the bytes its
// digest names and that no upload left a temporary file.
func requireNoPartialBlobs(ctx context.Context, t *testing.T, remote repository.Repository, root string) {
	t.Helper()
	err := remote.WalkBlobs(ctx, func(bi repository.BlobInfo) error {
		_, err := repository.ReadAll(ctx, remote, bi.Digest)
		return err
	})
	if err != nil {
		t.Fatalf("a blob in the repository is partial or corrupt: %v", err)
	}
	if ents, _ := os.ReadDir(filepath.Join(root, "tmp")); len(ents) > 0 {
		var names []string
		for _, e := range ents {
			names = append(names, e.Name())
		}
		t.Fatalf("temporary files left in the repository: %v", names)
	}
}
