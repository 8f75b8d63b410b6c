package integration

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	"github.com/aenv-dev/aenv/internal/bench"
	"github.com/aenv-dev/aenv/internal/repository"
	"github.com/aenv-dev/aenv/internal/repository/posixfs"
)

// TestRepositoryFullMidPublish: a node's posix_fs repository fills up (a small tmpfs)
// while it publishes a snapshot. The snapshot is answered and usable on the node, the
// repository never holds a complete record of it nor a partial blob, and once space is
// freed the node completes the publication by itself.
func TestRepositoryFullMidPublish(t *testing.T) {
	needNode(t)
	dir, err := os.MkdirTemp("", "aenv-it-full-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	// Room for the repository's directories and records, not for a snapshot's layers.
	if out, err := exec.Command("mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", dir).CombinedOutput(); err != nil {
		t.Skipf("cannot mount a tmpfs: %v: %s", err, out)
	}
	t.Cleanup(func() { _ = exec.Command("umount", "-l", dir).Run() })
	n := newNode(t, "AENV_SANDBOX_SHUTDOWN_ACTION=stop", "AENV_SNAPSHOT_SYNC_INTERVAL=1s",
		"AENV_REPOSITORY_POSIX_FS_PATH="+dir)
	n.start()
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	c := n.client()
	src := n.create(ctx, c)
	run(ctx, t, c, src, "echo v1 > /home/user/marker && head -c 16000000 /dev/urandom > /home/user/big")
	snapID := takeSnapshot(ctx, t, n, src.ID, "")
	child, err := c.Create(ctx, bench.CreateRequest{TemplateID: snapID, Timeout: 300, Secure: true})
	if err != nil {
		t.Fatalf("create from a snapshot the repository has no room for: %v", err)
	}
	n.observe()
	if got := run(ctx, t, c, child, "cat /home/user/marker"); got != "v1" {
		t.Fatalf("sandbox from the snapshot reads %q", got)
	}
	repo, err := posixfs.Open(dir, posixfs.Options{})
	if err != nil {
		t.Fatal(err)
	}
	time.Sleep(3 * time.Second) // uploads fail with ENOSPC and retry meanwhile
	if rec, err := repo.GetRecord(ctx, repository.KindSnapshot, snapID); err == nil && rec.State == repository.StateComplete {
		t.Fatal("the record is complete although the repository had no room for its layers")
	}
	if err := repo.WalkBlobs(ctx, func(bi repository.BlobInfo) error {
		_, err := repository.ReadAll(ctx, repo, bi.Digest)
		return err
	}); err != nil {
		t.Fatalf("a partial blob in the full repository: %v", err)
	}

	if out, err := exec.Command("mount", "-o", "remount,size=256m", dir).CombinedOutput(); err != nil {
		t.Fatalf("grow the tmpfs: %v: %s", err, out)
	}
	waitComplete(ctx, t, repo, snapID)
	killAll(ctx, t, c)
	n.stop()
	requireNoLeftovers(t, n, nil)
	if ents, _ := os.ReadDir(filepath.Join(dir, "tmp")); len(ents) > 0 {
		t.Errorf("%d temporary files left in the repository", len(ents))
	}
}
