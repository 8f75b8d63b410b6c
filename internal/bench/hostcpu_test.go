package bench

import (
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"
)

func TestParseStatBusy(t *testing.T) {
	for _, tc := range []struct {
		name, stat string
		want       time.Duration
		wantErr    bool
	}{
		// user nice system idle iowait irq softirq steal guest guest_nice: idle and
		// iowait are not busy, guest is inside user.
		{name: "all fields", stat: "cpu  100 2 50 9000 40 3 5 7 20 0\ncpu0 1 1 1 1 1 1 1 1 0 0\n", want: 1670 * time.Millisecond},
		{name: "older kernel, no guest", stat: "cpu 1 0 1 5 0 0 0 0\n", want: 20 * time.Millisecond},
		{name: "per-cpu line first", stat: "cpu0 1 1 1 1 1 1 1 1\n", wantErr: true},
		{name: "truncated", stat: "cpu 1 2 3\n", wantErr: true},
		{name: "not a number", stat: "cpu 1 x 3 4 5 6 7 8\n", wantErr: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := parseStatBusy([]byte(tc.stat))
			if (err != nil) != tc.wantErr {
				t.Fatalf("err = %v, want error %v", err, tc.wantErr)
			}
			if got != tc.want {
				t.Errorf("busy = %v, want %v", got, tc.want)
			}
		})
	}
}

func TestKthreadCPU(t *testing.T) {
	root := t.TempDir()
	// 9 is listed but gone (exited between the list and its stat): skipped.
	writeFile(t, filepath.Join(root, "2", "task", "2", "children"), "3 4 5 6 9 ")
	writeFile(t, filepath.Join(root, "3", "stat"), statLine("kdamond.0", 2, 300, 700, 0, 0))
	writeFile(t, filepath.Join(root, "4", "stat"), statLine("kworker/u8:2-events_unbound", 2, 0, 20, 0, 0))
	writeFile(t, filepath.Join(root, "5", "stat"), statLine("kworker/1:0H", 2, 0, 5, 0, 0))
	writeFile(t, filepath.Join(root, "6", "stat"), "6 (broken\n")
	got, err := kthreadCPU(root)
	if err != nil {
		t.Fatal(err)
	}
	want := map[string]time.Duration{"kdamond.0": 10 * time.Second, "kworker": 250 * time.Millisecond}
	if len(got) != len(want) {
		t.Fatalf("groups = %v, want %v", got, want)
	}
	for k, v := range want {
		if got[k] != v {
			t.Errorf("%s = %v, want %v", k, got[k], v)
		}
	}
	if _, err := kthreadCPU(t.TempDir()); err == nil {
		t.Error("a /proc without kthreadd's children read without error")
	}
}

func TestHostCostSince(t *testing.T) {
	before := hostReading{busy: 10 * time.Second, self: time.Second,
		kthreads: map[string]time.Duration{"kdamond.0": time.Second, "kworker": 2 * time.Second}}
	after := hostReading{busy: 14 * time.Second, self: 1500 * time.Millisecond,
		// kworker's sum fell (threads exited): counted as nothing, not negative.
		kthreads: map[string]time.Duration{"kdamond.0": 2 * time.Second, "kworker": time.Second, "ksoftirqd": 200 * time.Millisecond}}
	got := after.costSince(before, 10)
	want := HostCPUCost{Busy: 350 * time.Millisecond, KernelThreads: 120 * time.Millisecond,
		TopKernelThread: "kdamond.0", TopKernelThreadCPU: 100 * time.Millisecond}
	if got == nil || *got != want {
		t.Errorf("cost = %+v, want %+v", got, want)
	}
	if c := after.costSince(before, 0); c != nil {
		t.Errorf("no creates gave %+v, want nil", c)
	}
}

// TestHostCPURead reads this machine: busy time and the bench's own CPU only grow.
func TestHostCPURead(t *testing.T) {
	h := hostCPU{procRoot: "/proc"}
	a, err := h.read()
	if err != nil {
		t.Skipf("this machine's /proc gives no host CPU: %v", err)
	}
	for deadline := time.Now().Add(time.Second); time.Now().Before(deadline); {
	}
	b, err := h.read()
	if err != nil {
		t.Fatal(err)
	}
	if b.busy <= a.busy || b.self <= a.self {
		t.Errorf("a second of spinning: busy %v → %v, own %v → %v", a.busy, b.busy, a.self, b.self)
	}
}

// TestTopOther names the busiest process the CPUMeter does not count: not a kernel
// thread, not the node, its data plane, their children or the bench, and not in the
// sandboxes' cgroup.
func TestTopOther(t *testing.T) {
	root := t.TempDir()
	proc := func(pid int, name string, ppid, ticks int, cgroup string) {
		dir := filepath.Join(root, strconv.Itoa(pid))
		writeFile(t, filepath.Join(dir, "stat"), strings.Replace(statLine(name, ppid, ticks, 0, 0, 0), "42 (", strconv.Itoa(pid)+" (", 1))
		writeFile(t, filepath.Join(dir, "cgroup"), cgroup)
	}
	writeFile(t, filepath.Join(root, "stat"), "cpu 1 0 1 5 0 0 0 0\n")
	writeFile(t, filepath.Join(root, "2", "task", "2", "children"), "3")
	proc(2, "kthreadd", 0, 0, "")
	proc(3, "kdamond.0", 2, 100, "")
	proc(1, "process_api", 0, 10, "0::/\n")
	proc(10, "aenv", 1, 500, "0::/\n")  // the node: skipped
	proc(11, "crun", 10, 400, "0::/\n") // its child: counted once the node reaps it
	proc(20, "envd", 1, 300, "4:memory:/aenv/sb1\n3:cpu,cpuacct:/aenv/sb1\n")
	proc(21, "agent", 1, 50, "0::/system.slice\n")
	h := hostCPU{procRoot: root, skip: map[int]bool{10: true}, cgroupParent: "aenv"}
	before, err := h.read()
	if err != nil {
		t.Fatal(err)
	}
	if _, ok := before.procs[3]; ok {
		t.Error("a kernel thread read as another process")
	}
	if _, ok := before.procs[11]; ok {
		t.Error("the node's child read as another process")
	}
	proc(1, "process_api", 0, 40, "0::/\n")
	proc(20, "envd", 1, 900, "4:memory:/aenv/sb1\n3:cpu,cpuacct:/aenv/sb1\n")
	proc(21, "agent", 1, 60, "0::/system.slice\n")
	proc(30, "sshd", 1, 20, "0::/system.slice\n") // started in between: counts whole
	after, err := h.read()
	if err != nil {
		t.Fatal(err)
	}
	// envd used the most but is a sandbox's; process_api used 300 ms over 10 creates.
	if name, cpu := h.topOther(before, after, 10); name != "process_api" || cpu != 30*time.Millisecond {
		t.Errorf("top other = %s %v, want process_api 30ms", name, cpu)
	}
	if name, _ := h.topOther(after, after, 10); name != "" {
		t.Errorf("no CPU used, top other = %q", name)
	}
}
