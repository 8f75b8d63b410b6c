package oci

import (
	"fmt"
	"os"
	"slices"
	"strings"
	"testing"

	"github.com/aenv-dev/aenv/internal/sandbox"
)

// A hybrid host's cgroup mounts, as on these machines, plus lines that are not below the
// root or not cgroups.
const hybridTable = `25 1 0:22 / /sys rw - sysfs sysfs rw
30 25 0:26 / /sys/fs/cgroup rw - tmpfs tmpfs rw,mode=755
31 30 0:27 / /sys/fs/cgroup/cpu rw - cgroup cgroup rw,cpu
32 30 0:28 / /sys/fs/cgroup/cpuacct rw - cgroup cgroup rw,cpuacct
33 30 0:29 / /sys/fs/cgroup/cpuset rw - cgroup cgroup rw,cpuset
34 30 0:30 / /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory
35 30 0:31 / /sys/fs/cgroup/devices rw - cgroup cgroup rw,devices
36 30 0:32 / /sys/fs/cgroup/freezer rw - cgroup cgroup rw,freezer
37 30 0:33 / /sys/fs/cgroup/blkio rw - cgroup cgroup rw,blkio
38 30 0:34 / /sys/fs/cgroup/pids rw - cgroup cgroup rw,pids
39 30 0:35 / /sys/fs/cgroup/systemd rw - cgroup cgroup rw,name=systemd
40 30 0:36 / /sys/fs/cgroup/unified rw - cgroup2 cgroup2 rw
41 1 0:37 / /mnt/other/blkio rw - cgroup cgroup rw,blkio
`

func TestSplitCgroupMounts(t *testing.T) {
	for _, tc := range []struct {
		name, table string
		need, rest  []string
	}{
		{"hybrid", hybridTable,
			[]string{"/sys/fs/cgroup/cpu", "/sys/fs/cgroup/cpuacct", "/sys/fs/cgroup/memory", "/sys/fs/cgroup/devices", "/sys/fs/cgroup/freezer", "/sys/fs/cgroup/pids"},
			[]string{"/sys/fs/cgroup/cpuset", "/sys/fs/cgroup/blkio", "/sys/fs/cgroup/systemd", "/sys/fs/cgroup/unified"}},
		{"co-mounted", `30 25 0:26 / /sys/fs/cgroup rw - tmpfs tmpfs rw
31 30 0:27 / /sys/fs/cgroup/cpu,cpuacct rw - cgroup cgroup rw,cpu,cpuacct
32 30 0:28 / /sys/fs/cgroup/net_cls,net_prio rw - cgroup cgroup rw,net_cls,net_prio
33 30 0:29 / /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory
34 30 0:30 / /sys/fs/cgroup/perf_event rw - cgroup cgroup rw,perf_event
35 30 0:31 / /sys/fs/cgroup/hugetlb rw - cgroup cgroup rw,hugetlb
`, []string{"/sys/fs/cgroup/cpu,cpuacct", "/sys/fs/cgroup/memory"},
			[]string{"/sys/fs/cgroup/net_cls,net_prio", "/sys/fs/cgroup/perf_event", "/sys/fs/cgroup/hugetlb"}},
		{"pure v2", "30 25 0:26 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n", nil, nil},
		{"no needed controller mounted", `30 25 0:26 / /sys/fs/cgroup rw - tmpfs tmpfs rw
33 30 0:29 / /sys/fs/cgroup/cpuset rw - cgroup cgroup rw,cpuset
40 30 0:36 / /sys/fs/cgroup/unified rw - cgroup2 cgroup2 rw
`, nil, nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			need, rest := splitCgroupMounts([]byte(tc.table), "/sys/fs/cgroup/", sandboxControllers)
			if !slices.Equal(need, tc.need) || !slices.Equal(rest, tc.rest) {
				t.Errorf("got %v and %v, want %v and %v", need, rest, tc.need, tc.rest)
			}
		})
	}
}

// TestSandboxCgroupHierarchies checks that a sandbox is a cgroup only in the hierarchies
// of the controllers it needs, and sees only those in its /sys/fs/cgroup.
func TestSandboxCgroupHierarchies(t *testing.T) { eachRuntime(t, testSandboxCgroupHierarchies) }

func testSandboxCgroupHierarchies(t *testing.T, runtime string) {
	e := newTestBackend(t, func(c *Config) { c.Runtime = runtime })
	if e.b.v2 {
		t.Skip("pure cgroup v2 host: one hierarchy")
	}
	i := e.launch(t, "cgh1", sandbox.Resources{CPUCount: 1, MemoryMB: 64})
	raw, err := os.ReadFile(i.l.pid())
	if err != nil {
		t.Fatal(err)
	}
	cg, err := os.ReadFile(fmt.Sprintf("/proc/%s/cgroup", strings.TrimSpace(string(raw))))
	if err != nil {
		t.Fatal(err)
	}
	rel := e.b.cgroupsPath(i.cid)
	var in []string
	for _, l := range strings.Split(strings.TrimSpace(string(cg)), "\n") {
		// hierarchy-id:controllers:path
		parts := strings.SplitN(l, ":", 3)
		if len(parts) == 3 && parts[2] == rel {
			in = append(in, parts[1])
		}
	}
	slices.Sort(in)
	if want := []string{"cpu", "cpuacct", "devices", "freezer", "memory", "pids"}; !slices.Equal(in, want) {
		t.Errorf("the sandbox is a cgroup in %v, want %v\n%s", in, want, cg)
	}
	out, _ := e.sh(t, i, "grep -c ' /sys/fs/cgroup/[a-z]' /proc/self/mountinfo; grep -E ' /sys/fs/cgroup/(blkio|cpuset|systemd|unified) ' /proc/self/mountinfo")
	if lines := strings.Split(strings.TrimSpace(out), "\n"); len(lines) != 1 {
		t.Errorf("the sandbox sees hierarchies it is not in:\n%s", out)
	}
	if e.b.cgroupViewDir == "" {
		if runtime == "crun" {
			t.Fatal("crun sandboxes' /sys/fs/cgroup is a tmpfs each, not the shared view")
		}
		return
	}
	// Seen through the node's shared view, read-only, not a tmpfs of its own.
	out, _ = e.sh(t, i, "grep ' /sys/fs/cgroup ' /proc/self/mountinfo; ls /sys/fs/cgroup; mkdir /sys/fs/cgroup/x 2>/dev/null && echo writable")
	if strings.Contains(out, " - tmpfs ") || strings.Contains(out, "writable") || !strings.Contains(out, "memory") {
		t.Errorf("the sandbox's /sys/fs/cgroup: want a read-only bind listing its hierarchies:\n%s", out)
	}
}
