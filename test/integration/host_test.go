package integration

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/moby/sys/mountinfo"
)

// ownership is what a node's backend was seen to own: containers by id, with their sandbox
// id and network namespace. Warm containers (created ahead, no sandbox yet) are included.
type ownership struct {
	mu         sync.Mutex
	containers map[string]owned // by container id
}

type owned struct {
	sandboxID string // "" for a warm container
	netns     string
}

func newOwnership() *ownership {
	return &ownership{containers: map[string]owned{}}
}

// scan reads the backend's per-container state files (<data>/oci/sandboxes/<cid>/state.json);
// prefix names the node's network namespaces ("<prefix>-<slot>").
func (o *ownership) scan(dataDir, prefix string) error {
	dirs, err := filepath.Glob(filepath.Join(dataDir, "oci", "sandboxes", "*", "state.json"))
	if err != nil {
		return err
	}
	o.mu.Lock()
	defer o.mu.Unlock()
	for _, p := range dirs {
		raw, err := os.ReadFile(p)
		if err != nil {
			continue // removed while we looked
		}
		var st struct {
			ID          string `json:"id"`
			ContainerID string `json:"containerID"`
			SlotIndex   int    `json:"slotIndex"`
		}
		if err := json.Unmarshal(raw, &st); err != nil {
			return fmt.Errorf("%s: %w", p, err)
		}
		cid := st.ContainerID
		if cid == "" {
			cid = filepath.Base(filepath.Dir(p))
		}
		prev := o.containers[cid]
		if st.ID == "" {
			st.ID = prev.sandboxID // a warm container adopted later keeps its sandbox
		}
		o.containers[cid] = owned{sandboxID: st.ID, netns: prefix + "-" + strconv.Itoa(st.SlotIndex)}
	}
	return nil
}

// cidOf returns the container id running sandbox id.
func (o *ownership) cidOf(id string) string {
	o.mu.Lock()
	defer o.mu.Unlock()
	for cid, c := range o.containers {
		if c.sandboxID == id {
			return cid
		}
	}
	return ""
}

func (o *ownership) snapshot() map[string]owned {
	o.mu.Lock()
	defer o.mu.Unlock()
	out := make(map[string]owned, len(o.containers))
	for k, v := range o.containers {
		out[k] = v
	}
	return out
}

// container is one entry of the runtime's `list`.
type container struct {
	ID      string `json:"id"`
	Pid     int    `json:"pid"`
	Status  string `json:"status"`
	runtime string // the runtime whose root holds it
}

// runtimes are the OCI runtimes a node may run its containers with (backend.runtime);
// each keeps its state in <data>/oci/<name>.
var runtimes = []string{"runc", "crun"}

// runtimeList lists the containers in the node's runtime roots (<data>/oci/runc, crun).
func runtimeList(t testing.TB, dataDir string) map[string]container {
	t.Helper()
	out := map[string]container{}
	for _, rt := range runtimes {
		root := filepath.Join(dataDir, "oci", rt)
		if _, err := os.Stat(root); os.IsNotExist(err) {
			continue
		}
		// list fails on a container whose state the node is writing or removing at that
		// moment (a warm container being made, a sandbox stopping): ask again.
		var raw []byte
		var err error
		for try := 0; try < 20; try++ {
			if raw, err = exec.Command(rt, "--root", root, "list", "--format", "json").Output(); err == nil {
				break
			}
			time.Sleep(100 * time.Millisecond)
		}
		if err != nil {
			var stderr []byte
			if ee, ok := err.(*exec.ExitError); ok {
				stderr = ee.Stderr
			}
			t.Fatalf("%s list: %v: %s", rt, err, stderr)
		}
		var list []container
		if s := strings.TrimSpace(string(raw)); s != "" && s != "null" {
			if err := json.Unmarshal(raw, &list); err != nil {
				t.Fatalf("%s list: %v: %s", rt, err, raw)
			}
		}
		for _, c := range list {
			c.runtime = rt
			out[c.ID] = c
		}
	}
	return out
}

// mountsUnder lists mount points below dir, deepest first.
func mountsUnder(t testing.TB, dir string) []string {
	t.Helper()
	infos, err := mountinfo.GetMounts(mountinfo.PrefixFilter(dir))
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, m := range infos {
		if m.Mountpoint != dir {
			out = append(out, m.Mountpoint)
		}
	}
	slices.SortFunc(out, func(a, b string) int { return len(b) - len(a) })
	return out
}

// aenvNetns is the set of network namespaces named <prefix>-<n> on the host.
func aenvNetns(prefix string) map[string]bool {
	out := map[string]bool{}
	for name := range slotNames("/run/netns", prefix+"-") {
		out[name] = true
	}
	return out
}

// aenvVeths maps the host ends of a node's veths ("<prefix>h<slot>") to their slot's
// namespace name.
func aenvVeths(prefix string) map[string]string {
	out := map[string]string{}
	for name, slot := range slotNames("/sys/class/net", prefix+"h") {
		out[name] = prefix + "-" + slot
	}
	return out
}

// slotNames maps the names in dir made of prefix and a slot number to that number.
func slotNames(dir, prefix string) map[string]string {
	out := map[string]string{}
	ents, _ := os.ReadDir(dir)
	for _, e := range ents {
		if rest, ok := strings.CutPrefix(e.Name(), prefix); ok {
			if _, err := strconv.Atoi(rest); err == nil {
				out[e.Name()] = rest
			}
		}
	}
	return out
}

// linkIndex is the interface index of the network interface name, or 0 when there is none.
func linkIndex(name string) int {
	raw, err := os.ReadFile("/sys/class/net/" + name + "/ifindex")
	if err != nil {
		return 0
	}
	i, _ := strconv.Atoi(strings.TrimSpace(string(raw)))
	return i
}

// linkGoes reports whether the network interface name with index ifindex (0: the one of
// that name now) is gone within wait: no interface has the name any more, or another one
// does. A node's pool makes a freed slot's veth anew under the same name at once (the
// lowest free index), so the name alone can come back between two looks.
func linkGoes(name string, ifindex int, wait time.Duration) bool {
	if ifindex == 0 {
		ifindex = linkIndex(name)
	}
	for deadline := time.Now().Add(wait); ; time.Sleep(50 * time.Millisecond) {
		if i := linkIndex(name); i == 0 || i != ifindex {
			return true
		}
		if time.Now().After(deadline) {
			return false
		}
	}
}

// cgroupsOf lists the cgroup directories of a container under the node's cgroup parent
// (/sys/fs/cgroup/*/<parent>/<cid> on a v1 or hybrid host, /sys/fs/cgroup/<parent>/<cid> on
// a v2 one).
func cgroupsOf(parent, cid string) []string {
	a, _ := filepath.Glob(filepath.Join("/sys/fs/cgroup", "*", parent, cid))
	b, _ := filepath.Glob(filepath.Join("/sys/fs/cgroup", parent, cid))
	return append(a, b...)
}

// leftovers describes everything of the node's that exists on the host apart from the
// containers in keep (by container id): containers in its runtime root, mounts under its data
// dir, loop devices backed by files there, network namespaces and cgroups of containers it
// owned, and any namespace of the node's own slot prefix.
// Call it with the node stopped.
func leftovers(t testing.TB, n *node, keep map[string]bool) []string {
	t.Helper()
	var out []string
	for id, c := range runtimeList(t, n.dataDir) {
		if !keep[id] {
			out = append(out, fmt.Sprintf("container %s (%s)", id, c.Status))
		}
	}
	sharedFUSE := filepath.Join(n.dataDir, "dataplane", "fuse")
	for _, m := range mountsUnder(t, n.dataDir) {
		if m == filepath.Join(n.dataDir, "oci") {
			continue // the OCI data directory's bind onto itself, kept across restarts
		}
		if m == sharedFUSE && len(keep) > 0 {
			continue // the data plane's, serving the kept sandboxes' disks
		}
		if !keep[containerOf(n.dataDir, m)] {
			out = append(out, "mount "+m)
		}
	}
	for dev, backing := range loopDevices(n.dataDir) {
		owner := containerOf(n.dataDir, backing)
		if owner == "" {
			// A file of the data plane's shared mount: the sandbox is where it is mounted.
			owner = containerOf(n.dataDir, mountOfDevice(t, dev))
		}
		if !keep[owner] {
			out = append(out, fmt.Sprintf("loop device %s (backing %s)", dev, backing))
		}
	}
	keptNetns := map[string]bool{}
	seen := n.seen.snapshot()
	for cid, o := range seen {
		if keep[cid] {
			keptNetns[o.netns] = true
		}
	}
	for cid, o := range seen {
		if keep[cid] {
			continue
		}
		if _, err := os.Stat("/run/netns/" + o.netns); err == nil && !keptNetns[o.netns] {
			out = append(out, fmt.Sprintf("netns %s (of container %s)", o.netns, cid))
			keptNetns[o.netns] = true // report once
		}
		for _, d := range cgroupsOf(n.cgroupParent(), cid) {
			out = append(out, "cgroup "+d)
		}
	}
	if n.net.prefix != "" {
		// The names are this node's alone, so any namespace of them is its leftover.
		for ns := range aenvNetns(n.net.prefix) {
			if !keptNetns[ns] {
				out = append(out, "netns "+ns)
			}
		}
		// A released slot's host veth goes with its namespace, deleted by the kernel's
		// cleanup shortly after (or by a restarted node's reconcile after a crash), so
		// one still listed gets a moment before it counts.
		for veth, ns := range aenvVeths(n.net.prefix) {
			if !keptNetns[ns] && !linkGoes(veth, 0, 3*time.Second) {
				out = append(out, "veth "+veth)
			}
		}
	}
	slices.Sort(out)
	return slices.Compact(out)
}

// containerOf returns the container whose bundle directory holds path, or "".
func containerOf(dataDir, path string) string {
	rel, err := filepath.Rel(filepath.Join(dataDir, "oci", "sandboxes"), path)
	if err != nil || rel == "." || strings.HasPrefix(rel, "..") {
		return ""
	}
	return strings.Split(rel, string(filepath.Separator))[0]
}

// mountOfDevice is where the block device dev is mounted ("" when nowhere).
func mountOfDevice(t testing.TB, dev string) string {
	t.Helper()
	infos, err := mountinfo.GetMounts(func(m *mountinfo.Info) (skip, stop bool) { return m.Source != dev, false })
	if err != nil {
		t.Fatal(err)
	}
	if len(infos) == 0 {
		return ""
	}
	return infos[0].Mountpoint
}

// loopDevices maps the loop devices whose backing file lies under dir to that file.
func loopDevices(dir string) map[string]string {
	out := map[string]string{}
	files, _ := filepath.Glob("/sys/block/loop*/loop/backing_file")
	for _, f := range files {
		raw, err := os.ReadFile(f)
		if err != nil {
			continue
		}
		backing := strings.TrimSuffix(strings.TrimSpace(string(raw)), " (deleted)")
		if strings.HasPrefix(backing, dir+"/") {
			out["/dev/"+filepath.Base(filepath.Dir(filepath.Dir(f)))] = backing
		}
	}
	return out
}

// requireNoLeftovers fails the test when leftovers finds anything outside keep.
func requireNoLeftovers(t *testing.T, n *node, keep map[string]bool) {
	t.Helper()
	if left := leftovers(t, n, keep); len(left) > 0 {
		t.Fatalf("left behind:\n  %s", strings.Join(left, "\n  "))
	}
}

// forceCleanup removes what a failed test's node left under its data dir: helper processes
// that outlived it (an orphaned `runc create` names the data dir and can hold the node's
// /dev/fuse descriptors, and while one is open an unmount of a block root waits forever),
// containers (the runtime's delete -f also kills their processes and removes their cgroups), mounts
// and loop devices. The node's network and cgroup names are nodeNet.teardown's business.
func forceCleanup(t testing.TB, dataDir string, seen *ownership) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	killNaming(dataDir)
	for id, c := range runtimeList(t, dataDir) {
		root := filepath.Join(dataDir, "oci", c.runtime)
		if out, err := exec.CommandContext(ctx, c.runtime, "--root", root, "delete", "--force", id).CombinedOutput(); err != nil {
			t.Logf("cleanup: %s delete %s: %v: %s", c.runtime, id, err, out)
		}
	}
	for _, m := range mountsUnder(t, dataDir) {
		if out, err := exec.CommandContext(ctx, "umount", "-l", m).CombinedOutput(); err != nil {
			t.Logf("cleanup: umount %s: %v: %s", m, err, out)
		}
	}
	for dev := range loopDevices(dataDir) {
		if out, err := exec.CommandContext(ctx, "losetup", "-d", dev).CombinedOutput(); err != nil {
			t.Logf("cleanup: losetup -d %s: %v: %s", dev, err, out)
		}
	}
	_ = seen // the containers it names were removed through the runtime above
}

// killNaming SIGKILLs every process with an argument that is dir or lies under it.
func killNaming(dir string) {
	procs, _ := filepath.Glob("/proc/[0-9]*/cmdline")
	for _, p := range procs {
		raw, err := os.ReadFile(p)
		if err != nil {
			continue
		}
		for _, a := range strings.Split(string(raw), "\x00") {
			if a == dir || strings.HasPrefix(a, dir+"/") {
				if pid, err := strconv.Atoi(filepath.Base(filepath.Dir(p))); err == nil && pid != os.Getpid() {
					_ = syscall.Kill(pid, syscall.SIGKILL)
				}
				break
			}
		}
	}
}

// abortFUSE aborts the FUSE connections of the mounts under dir and returns how many it
// aborted. A process serving FUSE that is killed while one of its own threads waits on
// those mounts (through a loop device) cannot finish exiting until they are aborted.
func abortFUSE(dir string) int {
	_ = exec.Command("mount", "-t", "fusectl", "none", "/sys/fs/fuse/connections").Run()
	raw, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		return 0
	}
	n := 0
	for _, line := range strings.Split(string(raw), "\n") {
		f := strings.Fields(line)
		sep := slices.Index(f, "-")
		if len(f) < 5 || sep < 0 || sep+1 >= len(f) || !strings.HasPrefix(f[sep+1], "fuse") {
			continue
		}
		if f[4] != dir && !strings.HasPrefix(f[4], dir+"/") {
			continue
		}
		_, minor, ok := strings.Cut(f[2], ":")
		if !ok {
			continue
		}
		if os.WriteFile(filepath.Join("/sys/fs/fuse/connections", minor, "abort"), []byte("1"), 0o200) == nil {
			n++
		}
	}
	return n
}
