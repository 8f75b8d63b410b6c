package integration

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/aenv-dev/aenv/internal/bench"
	"github.com/aenv-dev/aenv/internal/repository"
	"github.com/aenv-dev/aenv/internal/repository/posixfs"
)

// nodeNet is what keeps two nodes on one host apart: each sweeps, at startup, every
// slot, nftables table and cgroup of its own names that it does not know.
type nodeNet struct {
	bridge, subnet, prefix, cgroup string
}

func (n nodeNet) env() []string {
	return []string{"AENV_NETWORK_BRIDGE=" + n.bridge, "AENV_NETWORK_SUBNET=" + n.subnet,
		"AENV_NETWORK_PREFIX=" + n.prefix, "AENV_BACKEND_CGROUP_PARENT=" + n.cgroup}
}

// leftovers lists the network namespaces and sandbox cgroups of n on the host.
func (n nodeNet) leftovers() []string {
	var out []string
	ents, _ := os.ReadDir("/run/netns")
	for _, e := range ents {
		if strings.HasPrefix(e.Name(), n.prefix+"-") {
			out = append(out, "netns "+e.Name())
		}
	}
	for _, root := range cgroupRoots(n.cgroup) {
		kids, _ := os.ReadDir(root)
		for _, k := range kids {
			if k.IsDir() {
				out = append(out, "cgroup "+filepath.Join(root, k.Name()))
			}
		}
	}
	return out
}

// teardown removes everything the node's names own on the host: namespaces, sandbox
// cgroups, the cgroup parent, the bridge and its nftables tables (which a node keeps
// across restarts, so a stopped node still has them).
func (n nodeNet) teardown(t testing.TB) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	ents, _ := os.ReadDir("/run/netns")
	for _, e := range ents {
		if strings.HasPrefix(e.Name(), n.prefix+"-") {
			if out, err := exec.CommandContext(ctx, "ip", "netns", "delete", e.Name()).CombinedOutput(); err != nil {
				t.Logf("cleanup: ip netns delete %s: %v: %s", e.Name(), err, out)
			}
		}
	}
	for _, root := range cgroupRoots(n.cgroup) {
		kids, _ := os.ReadDir(root)
		for _, k := range kids {
			if k.IsDir() {
				killCgroup(t, filepath.Join(root, k.Name()))
			}
		}
		_ = os.Remove(root)
	}
	_ = exec.CommandContext(ctx, "ip", "link", "delete", n.bridge).Run()
	script := fmt.Sprintf("table inet %[1]s {}\ndelete table inet %[1]s\ntable bridge %[1]s {}\ndelete table bridge %[1]s\n", n.bridge)
	nft := exec.CommandContext(ctx, "nft", "-f", "-")
	nft.Stdin = strings.NewReader(script)
	if out, err := nft.CombinedOutput(); err != nil {
		t.Logf("cleanup: nft delete tables %s: %v: %s", n.bridge, err, out)
	}
}

// newNode prepares a node on these names. Unlike newNode it does not wait for other
// nodes on the host to finish: with names of its own, no other node's sweep touches it.
func (n nodeNet) newNode(t testing.TB, env ...string) *node {
	t.Helper()
	bins := needNode(t)
	dd, err := os.MkdirTemp("", "aenv-it-")
	if err != nil {
		t.Fatal(err)
	}
	// Sandbox roots in user namespaces must traverse the data dir (MkdirTemp makes 0700).
	if err := os.Chmod(dd, 0o711); err != nil {
		t.Fatal(err)
	}
	nd := &node{t: t, bins: bins, dataDir: dd, key: "e2b_" + randHex(20), env: append(n.env(), env...), seen: newOwnership(), net: n}
	t.Cleanup(func() {
		nd.kill9()
		if t.Failed() {
			t.Logf("aenv serve (%s) output:\n%s", n.prefix, nd.output())
		}
		forceCleanup(t, dd, nd.seen)
		os.RemoveAll(dd)
	})
	return nd
}

// killCgroup SIGKILLs what is left in a sandbox cgroup and removes it. A container init
// can outlive everything that knew of it: a node killed while its runtime was creating a
// container leaves an init waiting for `start`, which the runtime never recorded (so
// its delete cannot find it) and which was cloned after killNaming's scan. A restarted
// node kills such processes (its reconcile kills every cgroup it does not adopt); a
// test's node may never restart.
func killCgroup(t testing.TB, dir string) {
	for deadline := time.Now().Add(5 * time.Second); ; {
		raw, _ := os.ReadFile(filepath.Join(dir, "cgroup.procs"))
		pids := strings.Fields(string(raw))
		if len(pids) == 0 || time.Now().After(deadline) {
			break
		}
		for _, p := range pids {
			if pid, err := strconv.Atoi(p); err == nil {
				t.Logf("cleanup: killing process %d left in %s", pid, dir)
				_ = syscall.Kill(pid, syscall.SIGKILL)
			}
		}
		time.Sleep(50 * time.Millisecond)
	}
	if err := os.Remove(dir); err != nil && !errors.Is(err, os.ErrNotExist) {
		t.Logf("cleanup: remove %s: %v", dir, err)
	}
}

// cgroupRoots are the directories of cgroup parent on this host (v2, or every v1
// hierarchy).
func cgroupRoots(parent string) []string {
	a, _ := filepath.Glob(filepath.Join("/sys/fs/cgroup", "*", parent))
	b, _ := filepath.Glob(filepath.Join("/sys/fs/cgroup", parent))
	return append(a, b...)
}

// api calls the node's REST API (the calls bench.Client lacks) and returns the answer.
func (n *node) api(ctx context.Context, method, path, body string, want int) ([]byte, error) {
	req, err := http.NewRequestWithContext(ctx, method, n.url()+path, strings.NewReader(body))
	if err != nil {
		return nil, err
	}
	req.Header.Set("X-API-Key", n.key)
	req.Header.Set("Content-Type", "application/json")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	out, err := io.ReadAll(resp.Body)
	if err != nil {
		return nil, err
	}
	if resp.StatusCode != want {
		return out, &bench.APIError{Op: method + " " + path, Status: resp.StatusCode, Message: string(out)}
	}
	return out, nil
}

// listsSnapshot reports whether the node's GET /snapshots knows id.
func (n *node) listsSnapshot(ctx context.Context, t testing.TB, id string) bool {
	t.Helper()
	out, err := n.api(ctx, http.MethodGet, "/snapshots?name="+url.QueryEscape(id), "", http.StatusOK)
	if err != nil {
		t.Fatal(err)
	}
	var list []struct {
		SnapshotID string `json:"snapshotID"`
	}
	if err := json.Unmarshal(out, &list); err != nil {
		t.Fatalf("GET /snapshots: %v: %s", err, out)
	}
	return len(list) == 1 && list[0].SnapshotID == id
}

// takeSnapshot snapshots sandbox id through the API (named name, unless empty) and
// returns the snapshot id; it skips the test where the base template is not layered on
// this host.
func takeSnapshot(ctx context.Context, t testing.TB, n *node, id, name string) string {
	t.Helper()
	body := `{}`
	if name != "" {
		body = `{"name":"` + name + `"}`
	}
	out, err := n.api(ctx, http.MethodPost, "/sandboxes/"+id+"/snapshots", body, http.StatusCreated)
	skipIfNotLayered(t, err)
	if err != nil {
		t.Fatalf("snapshot of %s: %v", id, err)
	}
	var info struct {
		SnapshotID string `json:"snapshotID"`
	}
	if err := json.Unmarshal(out, &info); err != nil || info.SnapshotID == "" {
		t.Fatalf("snapshot answer %s: %v", out, err)
	}
	return info.SnapshotID
}

// skipIfNotLayered skips the test when err is the node's 501 for a sandbox on a base
// template that is not layered on this host: it cannot be snapshotted, forked or paused
// to disk.
func skipIfNotLayered(t testing.TB, err error) {
	t.Helper()
	if se := (*bench.APIError)(nil); errors.As(err, &se) && se.Status == http.StatusNotImplemented {
		t.Skipf("the base template is not layered on this host, so its sandboxes cannot be snapshotted, forked or paused to disk: %v", err)
	}
}

// waitFor polls cond every 200 ms until it holds or d passes.
func waitFor(d time.Duration, cond func() bool) bool {
	deadline := time.Now().Add(d)
	for !cond() {
		if time.Now().After(deadline) {
			return false
		}
		time.Sleep(200 * time.Millisecond)
	}
	return true
}

// TestSharedPosixRepository runs two nodes on one host, each with its own data dir,
// port, network and cgroup parent, sharing one posix_fs repository directory (see
// sharedRepositoryFlow).
func TestSharedPosixRepository(t *testing.T) {
	dir, err := os.MkdirTemp("", "aenv-it-repo-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	repo, err := posixfs.Open(dir, posixfs.Options{})
	if err != nil {
		t.Fatal(err)
	}
	nets := []nodeNet{
		{bridge: "aenvra0", subnet: "10.93.0.0/16", prefix: "aenvra", cgroup: "aenv-it-ra"},
		{bridge: "aenvrb0", subnet: "10.94.0.0/16", prefix: "aenvrb", cgroup: "aenv-it-rb"},
	}
	sharedRepositoryFlow(t, nets, repo, "AENV_REPOSITORY_POSIX_FS_PATH="+dir)
}

// sharedRepositoryFlow runs two nodes on nets sharing repo (reached with the settings in
// env). A named snapshot taken on node A is published there and synced by node B, which
// creates a sandbox from it that sees A's file: the record names every layer of the
// stack, the base template's included, so B does not depend on its own base (built on B,
// never published). B cannot take the same name while it knows A's snapshot. The snapshot
// deleted on A stays on B while B's sandbox runs on it and leaves B's catalog once that
// sandbox is gone. Nothing of either node is left on the host.
func sharedRepositoryFlow(t *testing.T, nets []nodeNet, repo repository.Repository, env ...string) {
	// Registered first, so it runs last: after each node was killed and swept.
	t.Cleanup(func() {
		for _, n := range nets {
			n.teardown(t)
		}
	})
	common := append([]string{"AENV_SNAPSHOT_SYNC_INTERVAL=1s", "AENV_SANDBOX_SHUTDOWN_ACTION=stop"}, env...)
	a := nets[0].newNode(t, common...)
	b := nets[1].newNode(t, common...)
	a.start()
	b.start()
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	ca, cb := a.client(), b.client()

	src := a.create(ctx, ca)
	run(ctx, t, ca, src, "echo written-on-a > /home/user/marker")
	name := "shared-" + randHex(4)
	snapID := takeSnapshot(ctx, t, a, src.ID, name)
	start := time.Now()
	if !waitFor(90*time.Second, func() bool { return b.listsSnapshot(ctx, t, snapID) }) {
		t.Fatalf("node B never listed snapshot %s taken on node A", snapID)
	}
	t.Logf("snapshot %s usable on node B %s after it was taken on node A", snapID, time.Since(start).Round(time.Millisecond))
	requireCompleteRecord(ctx, t, repo, snapID)

	child, err := cb.Create(ctx, bench.CreateRequest{TemplateID: name, Timeout: 600, Secure: true})
	if err != nil {
		t.Fatalf("create from A's snapshot (by name) on node B: %v", err)
	}
	b.observe()
	if got := run(ctx, t, cb, child, "cat /home/user/marker"); got != "written-on-a" {
		t.Fatalf("node B's sandbox from the snapshot reads %q, want written-on-a", got)
	}
	run(ctx, t, cb, child, "echo written-on-b > /home/user/marker")
	if got := run(ctx, t, ca, src, "cat /home/user/marker"); got != "written-on-a" {
		t.Fatalf("node A's source sandbox reads %q after B's write", got)
	}
	// Names are unique across the nodes that know each other's snapshots.
	if _, err := b.api(ctx, http.MethodPost, "/sandboxes/"+child.ID+"/snapshots", `{"name":"`+name+`"}`, http.StatusConflict); err != nil {
		t.Fatalf("node B snapshot with node A's snapshot name: %v", err)
	}

	// Deleted on A (and so in the repository): B keeps it while its sandbox runs on it.
	if _, err := a.api(ctx, http.MethodDelete, "/templates/"+snapID, "", http.StatusNoContent); err != nil {
		t.Fatal(err)
	}
	time.Sleep(3 * time.Second) // a few syncs of B
	if !b.listsSnapshot(ctx, t, snapID) {
		t.Fatal("node B dropped a deleted snapshot its running sandbox uses")
	}
	if got := run(ctx, t, cb, child, "cat /home/user/marker"); got != "written-on-b" {
		t.Fatalf("node B's sandbox reads %q after the delete", got)
	}
	if err := cb.Kill(ctx, child.ID); err != nil {
		t.Fatal(err)
	}
	if !waitFor(30*time.Second, func() bool { return !b.listsSnapshot(ctx, t, snapID) }) {
		t.Fatal("node B still lists the deleted snapshot after its last sandbox was killed")
	}

	killAll(ctx, t, ca)
	a.stop()
	b.stop()
	for i, n := range []*node{a, b} {
		var left []string
		for id, c := range runtimeList(t, n.dataDir) {
			left = append(left, fmt.Sprintf("container %s (%s)", id, c.Status))
		}
		for _, m := range mountsUnder(t, n.dataDir) {
			left = append(left, "mount "+m)
		}
		left = append(left, nets[i].leftovers()...)
		if len(left) > 0 {
			t.Errorf("node %c left behind:\n  %s", 'A'+i, strings.Join(left, "\n  "))
		}
	}
}

// requireCompleteRecord checks, in the repository itself, that snapshot id is complete,
// names its whole stack (the base template's layer and at least the sealed upper on it:
// on an overlay root, the upper's own layers, role "upper") and that every blob it names
// is there.
func requireCompleteRecord(ctx context.Context, t *testing.T, repo repository.Repository, id string) repository.Record {
	t.Helper()
	rec, err := repo.GetRecord(ctx, repository.KindSnapshot, id)
	if err != nil {
		t.Fatalf("record of %s: %v", id, err)
	}
	if rec.State != repository.StateComplete {
		t.Fatalf("record of %s is %s, want complete", id, rec.State)
	}
	rootfs, upper := 0, 0
	for _, l := range rec.Layers {
		switch l.Role {
		case "rootfs":
			rootfs++
		case "upper":
			upper++
		}
		if _, err := repo.StatBlob(ctx, l.Digest); err != nil {
			t.Fatalf("record %s names blob %s (%s), not in the repository: %v", id, l.Digest, l.Role, err)
		}
	}
	if rootfs < 1 || rootfs+upper < 2 || upper == 1 {
		t.Fatalf("record %s names %d rootfs and %d upper layers; want the base's and the snapshot's own "+
			"(an overlay root's: its empty upper's and its own): %+v", id, rootfs, upper, rec.Layers)
	}
	return rec
}
