package snapshot

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"github.com/aenv-dev/aenv/internal/catalog"
	"github.com/aenv-dev/aenv/internal/repository"
	"github.com/aenv-dev/aenv/internal/repository/nodecache"
	"github.com/aenv-dev/aenv/internal/repository/posixfs"
)

// crashEnv carries the directories of the child node in TestKill9MidPublish.
const crashEnv = "AENV_SNAPSHOT_CRASH_CHILD"

type crashDirs struct {
	Repo, Cache, State, DB string
	Manifest               Manifest
}

// The node process is killed with SIGKILL while it uploads a snapshot. The
// record it left is pending (no other node uses it); a new process on the
// same directories finishes the publication from its journal.
func TestKill9MidPublish(t *testing.T) {
	if os.Getenv(crashEnv) != "" {
		crashChild(t)
		return
	}
	ctx := context.Background()
	root := t.TempDir()
	dirs := crashDirs{Repo: filepath.Join(root, "repo"), Cache: filepath.Join(root, "cache"),
		State: filepath.Join(root, "state"), DB: filepath.Join(root, "aenv.db")}
	files, _ := stackLayers(t, t.TempDir(), 3, 21)
	dirs.Manifest = testManifest(t, "snap-crash", files)
	b, _ := json.Marshal(dirs)

	cmd := exec.Command(os.Args[0], "-test.run=^TestKill9MidPublish$", "-test.count=1")
	cmd.Env = append(os.Environ(), crashEnv+"="+string(b))
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	killed := false
	t.Cleanup(func() {
		if !killed {
			cmd.Process.Kill()
			cmd.Wait()
		}
	})
	sc := bufio.NewScanner(out)
	for sc.Scan() && !strings.Contains(sc.Text(), "uploading") {
	}
	if err := cmd.Process.Signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	cmd.Wait()
	killed = true

	remote, err := posixfs.Open(dirs.Repo, posixfs.Options{})
	if err != nil {
		t.Fatal(err)
	}
	rec, err := remote.GetRecord(ctx, repository.KindSnapshot, "snap-crash")
	if err != nil || rec.State != repository.StatePending {
		t.Fatalf("record after the kill: %+v %v", rec, err)
	}
	other := newNode(t, "node-b", remote, Options{})
	if res, err := other.pub.Sync(ctx); err != nil || len(res.Added) != 0 {
		t.Fatalf("another node synced a half-published snapshot: %+v %v", res, err)
	}

	cache, err := nodecache.Open(ctx, remote, nodecache.Options{Dir: dirs.Cache, MaxBytes: 512 << 20})
	if err != nil {
		t.Fatal(err)
	}
	cat, err := catalog.Open(dirs.DB)
	if err != nil {
		t.Fatal(err)
	}
	defer cat.Close()
	p, err := New(cache, cat.Templates(), Options{NodeID: "node-a", StateDir: dirs.State})
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	hs, err := p.Resume(ctx)
	if err != nil || len(hs) != 1 {
		t.Fatalf("Resume = %d handles, %v", len(hs), err)
	}
	if err := hs[0].Wait(ctx); err != nil {
		t.Fatal(err)
	}
	rec, err = remote.GetRecord(ctx, repository.KindSnapshot, "snap-crash")
	if err != nil || rec.State != repository.StateComplete || len(rec.Layers) != 3 {
		t.Fatalf("record after resume: %+v %v", rec, err)
	}
	if res, err := other.pub.Sync(ctx); err != nil || len(res.Added) != 1 {
		t.Fatalf("sync after resume: %+v %v", res, err)
	}
}

// crashChild publishes with uploads held forever and says when it is
// uploading; the parent kills it there.
func crashChild(t *testing.T) {
	var dirs crashDirs
	if err := json.Unmarshal([]byte(os.Getenv(crashEnv)), &dirs); err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	remote, err := posixfs.Open(dirs.Repo, posixfs.Options{})
	if err != nil {
		t.Fatal(err)
	}
	g := newGated(remote)
	cache, err := nodecache.Open(ctx, g, nodecache.Options{Dir: dirs.Cache, MaxBytes: 512 << 20})
	if err != nil {
		t.Fatal(err)
	}
	cat, err := catalog.Open(dirs.DB)
	if err != nil {
		t.Fatal(err)
	}
	p, err := New(cache, cat.Templates(), Options{NodeID: "node-a", StateDir: dirs.State})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := p.Publish(ctx, dirs.Manifest); err != nil {
		t.Fatal(err)
	}
	<-g.puts
	os.Stdout.WriteString("uploading\n")
	select {} // killed here
}

// TestRestartRemovesTempFiles: temporary files a killed node left in the publisher's
// state (an interrupted fetch, atomic writes of digests, records and journals) are
// removed when the publisher opens again; the state files themselves stay.
func TestRestartRemovesTempFiles(t *testing.T) {
	remote, err := posixfs.Open(t.TempDir(), posixfs.Options{})
	if err != nil {
		t.Fatal(err)
	}
	n := newNode(t, "node-a", remote, Options{})
	n.pub.Close()
	left := []string{"layers/.fetch-1", "digests/.tmp-2", "records/.tmp-3", "publishing/.tmp-4", "blockhashes/.tmp-5"}
	kept := []string{"records/keep.json", "blockhashes/" + strings.Repeat("ab", 32) + ".bh"}
	for _, f := range append(left, kept...) {
		if err := os.WriteFile(filepath.Join(n.state, f), []byte("{}"), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	n.open(t, remote)
	for _, f := range left {
		if _, err := os.Stat(filepath.Join(n.state, f)); !errors.Is(err, fs.ErrNotExist) {
			t.Errorf("%s after a restart: %v", f, err)
		}
	}
	for _, f := range kept {
		if _, err := os.Stat(filepath.Join(n.state, f)); err != nil {
			t.Errorf("%s removed: %v", f, err)
		}
	}
}
