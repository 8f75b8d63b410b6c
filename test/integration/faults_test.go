package integration

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/aenv-dev/aenv/internal/bench"
	"github.com/aenv-dev/aenv/internal/orchestrator"
	"github.com/aenv-dev/aenv/internal/repository"
	"github.com/aenv-dev/aenv/internal/repository/posixfs"
)

// TestKill9MidSnapshotForkPause kills the node (SIGKILL, through the debug crash point
// orchestrator.CrashPointEnv) at each window of a snapshot, a fork and a pause to disk of
// a sandbox on the layered base, restarts it on the same data dir and checks:
//   - the source sandbox is intact in its last consistent state: still running (its
//     layered root is served by the data plane, which outlives the node: same init, its
//     files, writable, and it snapshots again), or paused to disk once the pause was
//     recorded (it resumes with its files); a child of the fork that was registered
//     (the first one, at fork:launch) runs on with the source's files, the others are
//     removed;
//   - every snapshot the node lists works (a sandbox created from it sees the file), and
//     every record in the repository is complete once the restarted node has finished the
//     publications it journaled, naming only blobs the repository has;
//   - after deleting every snapshot, killing every sandbox and stopping the node, nothing
//     is left: containers, mounts, loop devices, network namespaces, cgroups, capture
//     records, layer files, publication journals, temporary files.
func TestKill9MidSnapshotForkPause(t *testing.T) {
	for _, tc := range []struct {
		point string
		// act starts the operation the node dies in.
		act func(ctx context.Context, n *node, id string) error
		// wantSource is the source's state after the restart ("" = gone); wantSnaps
		// the number of snapshots the node lists.
		wantSource string
		wantSnaps  int
		// children: registered fork children run on (at least one).
		children bool
	}{
		{orchestrator.CrashSnapshotCaptured, snapshotOf, "running", 0, false},
		{orchestrator.CrashSnapshotRegistered, snapshotOf, "running", 1, false},
		{orchestrator.CrashSnapshotPublishing, snapshotOf, "running", 1, false},
		{orchestrator.CrashForkCaptured, forkOf(3), "running", 0, false},
		{orchestrator.CrashForkLaunched, forkOf(3), "running", 0, true},
		{orchestrator.CrashPauseCaptured, pauseToDisk, "running", 0, false},
		{orchestrator.CrashPausePersisted, pauseToDisk, "paused", 0, false},
	} {
		t.Run(strings.ReplaceAll(tc.point, ":", "-"), func(t *testing.T) {
			n := newNode(t, "AENV_SANDBOX_SHUTDOWN_ACTION=stop", "AENV_SNAPSHOT_SYNC_INTERVAL=1s",
				orchestrator.CrashPointEnv+"="+tc.point)
			n.start()
			ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
			defer cancel()
			c := n.client()
			src := n.create(ctx, c)
			// Big enough that the publication is still uploading when the node dies.
			run(ctx, t, c, src, "echo v1 > /home/user/marker && head -c 64000000 /dev/urandom > /home/user/big")
			initPid := n.initPid(t, src.ID)

			err := tc.act(ctx, n, src.ID)
			skipIfNotLayered(t, err)
			if err == nil {
				t.Fatalf("the operation answered although the node was to die at %s", tc.point)
			}
			if !n.waitExit(30 * time.Second) {
				if !strings.Contains(n.output(), "crash point reached") {
					t.Fatalf("the node did not reach crash point %s:\n%s", tc.point, n.output())
				}
				// The data plane serves the roots: nothing of the node waits on FUSE.
				t.Errorf("the node, killed at %s, is stuck exiting; aborted %d FUSE connections under its data dir",
					tc.point, abortFUSE(n.dataDir))
				if !n.waitExit(30 * time.Second) {
					t.Fatalf("the node killed at %s did not exit even after its FUSE connections were aborted", tc.point)
				}
			}
			n.restartWith()

			got := states(ctx, t, c)
			if st := got[src.ID]; st != tc.wantSource {
				t.Errorf("after the restart the source is %q, want %q (all: %v)", st, tc.wantSource, got)
			}
			kids := 0
			for id := range got {
				switch {
				case id == src.ID:
				case tc.children && got[id] == "running":
					kids++
					kid, err := c.Connect(ctx, id, 300)
					if err != nil {
						t.Errorf("connect to fork child %s: %v", id, err)
						continue
					}
					if out, err := c.Run(ctx, kid, "cat /home/user/marker"); err != nil || strings.TrimSpace(out.Stdout) != "v1" {
						t.Errorf("fork child %s adopted across the crash reads %+v, %v", id, out, err)
					}
				default:
					t.Errorf("sandbox %s (%s) appeared across the crash", id, got[id])
				}
			}
			if tc.children && kids == 0 {
				t.Errorf("no fork child registered before the crash runs on")
			}
			if got[src.ID] == "running" {
				if pid := n.initPid(t, src.ID); pid != initPid {
					t.Errorf("the adopted source's init is pid %d, was %d", pid, initPid)
				}
				if out := run(ctx, t, c, src, "cat /home/user/marker; wc -c < /home/user/big; echo v2 > /home/user/marker2; cat /home/user/marker2"); out != "v1\n64000000\nv2" {
					t.Errorf("adopted source reads %q", out)
				}
			}
			if got[src.ID] == "paused" {
				if _, err := c.Connect(ctx, src.ID, 300); err != nil {
					t.Fatalf("resume the sandbox paused before the crash: %v", err)
				}
				n.observe()
				if out := run(ctx, t, c, src, "cat /home/user/marker; wc -c < /home/user/big"); out != "v1\n64000000" {
					t.Errorf("resumed sandbox reads %q", out)
				}
			}
			snaps := n.snapshots(ctx, t)
			if len(snaps) != tc.wantSnaps {
				t.Errorf("after the restart the node lists %d snapshots %v, want %d", len(snaps), snaps, tc.wantSnaps)
			}
			for _, id := range snaps {
				sb, err := c.Create(ctx, bench.CreateRequest{TemplateID: id, Timeout: 300, Secure: true})
				if err != nil {
					t.Errorf("create from snapshot %s taken across the crash: %v", id, err)
					continue
				}
				n.observe()
				if out := run(ctx, t, c, sb, "cat /home/user/marker; wc -c < /home/user/big"); out != "v1\n64000000" {
					t.Errorf("sandbox from snapshot %s reads %q", id, out)
				}
				waitComplete(ctx, t, n.repo(t), id)
			}
			requireRepositoryConsistent(ctx, t, n)

			for _, id := range snaps {
				if _, err := n.api(ctx, http.MethodDelete, "/templates/"+id, "", http.StatusNoContent); err != nil {
					t.Fatal(err)
				}
			}
			killAll(ctx, t, c)
			n.stop()
			requireNoLeftovers(t, n, nil)
			requireNoStateLeftovers(t, n)
		})
	}
}

func snapshotOf(ctx context.Context, n *node, id string) error {
	_, err := n.api(ctx, http.MethodPost, "/sandboxes/"+id+"/snapshots", `{}`, http.StatusCreated)
	return err
}

func forkOf(count int) func(ctx context.Context, n *node, id string) error {
	return func(ctx context.Context, n *node, id string) error {
		_, err := n.api(ctx, http.MethodPost, "/sandboxes/"+id+"/fork", fmt.Sprintf(`{"count":%d}`, count), http.StatusCreated)
		return err
	}
}

func pauseToDisk(ctx context.Context, n *node, id string) error {
	_, err := n.api(ctx, http.MethodPost, "/sandboxes/"+id+"/pause", `{"memory":false}`, http.StatusNoContent)
	return err
}

// restartWith restarts the node (SIGTERM, or nothing when it already died) with env
// added to its settings for this run only.
func (n *node) restartWith(env ...string) {
	n.t.Helper()
	if !n.waitExit(0) {
		n.stop()
	}
	base := slices.DeleteFunc(slices.Clone(n.env), func(s string) bool {
		return strings.HasPrefix(s, orchestrator.CrashPointEnv+"=")
	})
	n.env = append(base, env...)
	n.start()
}

// waitExit waits up to d for the serve process to exit by itself and reports whether it
// did (true when none runs).
func (n *node) waitExit(d time.Duration) bool {
	n.mu.Lock()
	cmd, done := n.cmd, n.done
	n.mu.Unlock()
	if cmd == nil {
		return true
	}
	select {
	case <-done:
	case <-time.After(d):
		return false
	}
	n.mu.Lock()
	n.cmd, n.done = nil, nil
	n.mu.Unlock()
	return true
}

// snapshots lists the ids of the node's snapshots.
func (n *node) snapshots(ctx context.Context, t *testing.T) []string {
	t.Helper()
	out, err := n.api(ctx, http.MethodGet, "/snapshots?limit=100", "", http.StatusOK)
	if err != nil {
		t.Fatal(err)
	}
	var list []struct {
		SnapshotID string `json:"snapshotID"`
	}
	if err := json.Unmarshal(out, &list); err != nil {
		t.Fatalf("GET /snapshots: %v: %s", err, out)
	}
	ids := make([]string, 0, len(list))
	for _, s := range list {
		ids = append(ids, s.SnapshotID)
	}
	return ids
}

// repo opens the node's posix_fs repository (the default, under its data dir).
func (n *node) repo(t *testing.T) repository.Repository {
	t.Helper()
	r, err := posixfs.Open(filepath.Join(n.dataDir, "repository"), posixfs.Options{})
	if err != nil {
		t.Fatal(err)
	}
	return r
}

// waitComplete waits for snapshot id's record in repo to be complete, then checks it.
func waitComplete(ctx context.Context, t *testing.T, rp repository.Repository, id string) {
	t.Helper()
	var last error
	ok := waitFor(2*time.Minute, func() bool {
		rec, err := rp.GetRecord(ctx, repository.KindSnapshot, id)
		if err == nil && rec.State != repository.StateComplete {
			err = fmt.Errorf("record is %s", rec.State)
		}
		last = err
		return err == nil
	})
	if !ok {
		t.Fatalf("snapshot %s never completed in the repository: %v", id, last)
	}
	requireCompleteRecord(ctx, t, rp, id)
}

// requireRepositoryConsistent checks every record of the node's repository: complete,
// or pending with the node still holding its journal (it finishes it); and every blob a
// record names is there.
func requireRepositoryConsistent(ctx context.Context, t *testing.T, n *node) {
	t.Helper()
	repo := n.repo(t)
	for _, kind := range repository.Kinds() {
		page, err := repo.ListRecords(ctx, kind, repository.ListOptions{Limit: repository.MaxListLimit})
		if err != nil {
			t.Fatal(err)
		}
		for _, rec := range page.Records {
			if rec.State != repository.StateComplete {
				if _, err := os.Stat(filepath.Join(n.dataDir, "snapshot", "publishing", rec.ID+".json")); err != nil {
					t.Errorf("record %s %s is %s and no journal finishes it", kind, rec.ID, rec.State)
				}
				continue
			}
			for _, l := range rec.Layers {
				if _, err := repo.StatBlob(ctx, l.Digest); err != nil {
					t.Errorf("complete record %s names blob %s, missing: %v", rec.ID, l.Digest, err)
				}
			}
		}
	}
}

// requireNoStateLeftovers checks a stopped node that holds no sandbox and no snapshot:
// its backend keeps no capture record or snapshot layer, its publisher no journal, and no
// temporary file is left anywhere in its data dir. The directories in skip are not
// looked into.
func requireNoStateLeftovers(t *testing.T, n *node, skip ...string) {
	t.Helper()
	var left []string
	for _, dir := range []string{"oci/captures", "oci/layers", "snapshot/publishing", "repository/tmp", "repository-cache/tmp"} {
		if slices.Contains(skip, dir) {
			continue
		}
		ents, _ := os.ReadDir(filepath.Join(n.dataDir, dir))
		for _, e := range ents {
			left = append(left, filepath.Join(dir, e.Name()))
		}
	}
	_ = filepath.WalkDir(n.dataDir, func(p string, d os.DirEntry, err error) error {
		if err != nil {
			return nil
		}
		name := d.Name()
		if strings.HasSuffix(name, ".tmp") || strings.HasPrefix(name, ".fetch-") || strings.Contains(name, ".tmp-") {
			left = append(left, p)
		}
		return nil
	})
	if len(left) > 0 {
		t.Errorf("state left behind:\n  %s", strings.Join(left, "\n  "))
	}
}
