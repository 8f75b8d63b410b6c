package bench

import (
	"context"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
)

func writeFile(t *testing.T, path, content string) {
	t.Helper()
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(path, []byte(content), 0o644); err != nil {
		t.Fatal(err)
	}
}

// statLine is a /proc/<pid>/stat line with the given command name, parent and times (ticks).
func statLine(comm string, ppid int, utime, stime, cutime, cstime int) string {
	f := []string{"S", strconv.Itoa(ppid), "1", "1", "0", "-1", "4194560", "100", "0", "0", "0",
		strconv.Itoa(utime), strconv.Itoa(stime), strconv.Itoa(cutime), strconv.Itoa(cstime), "20", "0", "12"}
	return "42 (" + comm + ") " + strings.Join(f, " ") + "\n"
}

func TestProcCPU(t *testing.T) {
	for _, tc := range []struct {
		name, stat             string
		wantSelf, wantChildren time.Duration
		wantErr                bool
	}{
		{name: "plain", stat: statLine("aenv", 1, 150, 50, 30, 20), wantSelf: 2 * time.Second, wantChildren: 500 * time.Millisecond},
		{name: "name with spaces and parens", stat: statLine("a b) (c", 1, 1, 2, 3, 4), wantSelf: 30 * time.Millisecond, wantChildren: 70 * time.Millisecond},
		{name: "truncated", stat: "42 (aenv) S 1 1 1\n", wantErr: true},
		{name: "no parens", stat: "42 aenv S\n", wantErr: true},
		{name: "not a number", stat: strings.Replace(statLine("aenv", 1, 1, 2, 3, 4), " 1 2 3 4 ", " x 2 3 4 ", 1), wantErr: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			root := t.TempDir()
			writeFile(t, filepath.Join(root, "42", "stat"), tc.stat)
			self, children, err := procCPU(root, 42, false)
			if (err != nil) != tc.wantErr {
				t.Fatalf("err = %v, want error %v", err, tc.wantErr)
			}
			if self != tc.wantSelf || children != tc.wantChildren {
				t.Errorf("got %v, %v; want %v, %v", self, children, tc.wantSelf, tc.wantChildren)
			}
		})
	}
	if _, _, err := procCPU(t.TempDir(), 7, false); err == nil {
		t.Error("a missing process read without error")
	}
}

// TestProcCPUPrecise reads this process both ways: the CPU clock is in nanoseconds, at
// least what the ticks say and less than a tick more for each of utime and stime.
func TestProcCPUPrecise(t *testing.T) {
	for end := time.Now().Add(30 * time.Millisecond); time.Now().Before(end); {
	}
	ticks, _, err := procCPU("/proc", os.Getpid(), false)
	if err != nil {
		t.Fatal(err)
	}
	clock, _, err := procCPU("/proc", os.Getpid(), true)
	if err != nil {
		t.Fatal(err)
	}
	tick := time.Second / clockTick
	if clock < ticks || clock-ticks >= 2*tick+5*time.Millisecond {
		t.Fatalf("cpu clock %v, ticks %v: want the clock within two ticks above", clock, ticks)
	}
	if clock%tick == 0 {
		t.Fatalf("cpu clock %v is a whole number of ticks", clock)
	}
	if _, _, err := procCPU("/proc", 1<<22+1, true); err == nil {
		t.Error("a process that cannot exist read without error")
	}
}

func TestCgroupCPU(t *testing.T) {
	for _, tc := range []struct {
		name, content string
		unified       bool
		want          time.Duration
		wantErr       bool
	}{
		{name: "v2", unified: true, content: "usage_usec 1500\nuser_usec 1000\nsystem_usec 500\n", want: 1500 * time.Microsecond},
		{name: "v2 without usage", unified: true, content: "user_usec 1000\n", wantErr: true},
		{name: "v1", content: "123456789\n", want: 123456789},
		{name: "v1 garbage", content: "lots\n", wantErr: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := filepath.Join(t.TempDir(), "f")
			writeFile(t, p, tc.content)
			got, err := cgroupCPU(p, tc.unified)
			if (err != nil) != tc.wantErr || got != tc.want {
				t.Errorf("got %v, %v; want %v, error %v", got, err, tc.want, tc.wantErr)
			}
		})
	}
}

// fakeNodeProc lays out a /proc with a node (pid 100) listening on port 8714 through socket
// inode 555, a data plane it started (101), a data plane of another node (102) and the
// node's environment, plus a cgroup root of the given kind.
func fakeNodeProc(t *testing.T, unified bool) (procRoot, cgRoot string) {
	procRoot, cgRoot = t.TempDir(), t.TempDir()
	writeFile(t, filepath.Join(procRoot, "net", "tcp"),
		"  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n"+
			"   0: 0100007F:220A 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 555 1 0 100 0 0 10 0\n"+
			"   1: 0100007F:220A 0100007F:9C40 01 00000000:00000000 00:00000000 00000000     0        0 556 1 0 100 0 0 10 0\n")
	writeFile(t, filepath.Join(procRoot, "100", "stat"), statLine("aenv", 1, 100, 100, 10, 10))
	writeFile(t, filepath.Join(procRoot, "100", "cmdline"), "aenv\x00serve\x00")
	writeFile(t, filepath.Join(procRoot, "100", "environ"), "PATH=/bin\x00AENV_BACKEND_CGROUP_PARENT=test/parent\x00")
	writeFile(t, filepath.Join(procRoot, "101", "stat"), statLine("aenv", 100, 5, 5, 0, 0))
	writeFile(t, filepath.Join(procRoot, "101", "cmdline"), "/bin/aenv\x00dataplane\x00--dir\x00/data/a/dataplane\x00")
	writeFile(t, filepath.Join(procRoot, "102", "stat"), statLine("aenv", 1, 7, 7, 0, 0))
	writeFile(t, filepath.Join(procRoot, "102", "cmdline"), "/bin/aenv\x00dataplane\x00--dir\x00/data/b/dataplane\x00")
	for pid, links := range map[string][]string{"100": {"socket:[556]", "socket:[555]", "/data/a/catalog.db"}, "101": {"socket:[9]"}} {
		if err := os.MkdirAll(filepath.Join(procRoot, pid, "fd"), 0o755); err != nil {
			t.Fatal(err)
		}
		for i, l := range links {
			if err := os.Symlink(l, filepath.Join(procRoot, pid, "fd", strconv.Itoa(i))); err != nil {
				t.Fatal(err)
			}
		}
	}
	if unified {
		writeFile(t, filepath.Join(cgRoot, "cgroup.controllers"), "cpu memory pids\n")
		writeFile(t, filepath.Join(cgRoot, "test", "parent", "cpu.stat"), "usage_usec 3000\n")
	} else {
		writeFile(t, filepath.Join(cgRoot, "cpuacct", "test", "parent", "cpuacct.usage"), "3000000\n")
	}
	return procRoot, cgRoot
}

func TestDiscoverNodeAndMeter(t *testing.T) {
	for _, unified := range []bool{true, false} {
		t.Run("unified="+strconv.FormatBool(unified), func(t *testing.T) {
			procRoot, cgRoot := fakeNodeProc(t, unified)
			src, err := DiscoverNode(procRoot, 8714)
			if err != nil {
				t.Fatal(err)
			}
			if src.NodePID != 100 || len(src.DataPlanePIDs) != 1 || src.DataPlanePIDs[0] != 101 || src.CgroupParent != "test/parent" {
				t.Fatalf("discovered %+v", src)
			}
			src.CgroupRoot = cgRoot
			m, err := NewCPUMeter(src)
			if err != nil {
				t.Fatal(err)
			}
			r, err := m.Read()
			if err != nil {
				t.Fatal(err)
			}
			want := CPUReading{Node: 2 * time.Second, Children: 200 * time.Millisecond, DataPlane: 100 * time.Millisecond, Sandboxes: 3 * time.Millisecond}
			if r != want {
				t.Errorf("read %+v, want %+v", r, want)
			}
		})
	}
	procRoot, _ := fakeNodeProc(t, true)
	if _, err := DiscoverNode(procRoot, 8715); err == nil {
		t.Error("found a node on a port nothing listens on")
	}
}

func TestCPUMeterBadSources(t *testing.T) {
	if _, err := NewCPUMeter(CPUSources{}); err == nil {
		t.Error("a meter without a node process")
	}
	if _, err := NewCPUMeter(CPUSources{ProcRoot: t.TempDir(), NodePID: 5}); err == nil {
		t.Error("a meter of a process that does not exist")
	}
	// A sandboxes' cgroup the backend has not made yet reads as zero.
	procRoot, cgRoot := fakeNodeProc(t, true)
	m, err := NewCPUMeter(CPUSources{ProcRoot: procRoot, CgroupRoot: cgRoot, NodePID: 100, CgroupParent: "not/yet"})
	if err != nil {
		t.Fatal(err)
	}
	if r, err := m.Read(); err != nil || r.Sandboxes != 0 {
		t.Errorf("read %+v, %v", r, err)
	}
}

// TestCPUMeterOwnProcess reads this very process: the CPU it burns between two readings
// shows in the node figure, as getrusage counts it.
func TestCPUMeterOwnProcess(t *testing.T) {
	m, err := NewCPUMeter(CPUSources{NodePID: os.Getpid()})
	if err != nil {
		t.Fatal(err)
	}
	before, err := m.Read()
	if err != nil {
		t.Fatal(err)
	}
	var ru0, ru1 syscall.Rusage
	_ = syscall.Getrusage(syscall.RUSAGE_SELF, &ru0)
	x := 0
	for {
		for i := range 1_000_000 {
			x += i
		}
		_ = syscall.Getrusage(syscall.RUSAGE_SELF, &ru1)
		if cpuOf(ru1)-cpuOf(ru0) >= 300*time.Millisecond {
			break
		}
	}
	after, err := m.Read()
	if err != nil {
		t.Fatal(err)
	}
	// /proc counts in 10 ms ticks: allow two ticks of rounding at either reading.
	if got := after.Sub(before).Node; got < 300*time.Millisecond-20*time.Millisecond {
		t.Errorf("the node figure grew by %v while this process burnt %v (x=%d)", got, cpuOf(ru1)-cpuOf(ru0), x)
	}
	if _, err := m.Quiesce(context.Background(), 300*time.Millisecond); err != nil {
		t.Fatal(err)
	}
}

func cpuOf(ru syscall.Rusage) time.Duration {
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

func TestCostAndMedian(t *testing.T) {
	d := CPUReading{Node: 30 * time.Millisecond, Children: 12 * time.Millisecond, DataPlane: 8 * time.Millisecond, Sandboxes: 10 * time.Millisecond}
	c := costOf(d, 2)
	if c.Total != 30*time.Millisecond || c.Node != 15*time.Millisecond || c.Helpers != 10*time.Millisecond ||
		c.Runtime != 6*time.Millisecond || c.DataPlane != 4*time.Millisecond || c.Ops != 2 {
		t.Errorf("costOf = %+v", c)
	}
	if costOf(d, 0) != nil {
		t.Error("a cost of no operations")
	}
	m := medianCost([]*CPUCost{{Total: 5}, nil, {Total: 1}, {Total: 3}})
	if m == nil || m.Total != 3 {
		t.Errorf("median = %+v", m)
	}
	if medianCost([]*CPUCost{nil}) != nil {
		t.Error("a median of nothing")
	}
}
