package bench

import (
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"
)

// hostCPU reads what the whole machine spends, beside the node's own sources: all CPUs'
// busy time and its kernel threads'. A fill whose rate falls while its CPU per create
// stays flat is waiting on something the sources do not cover, and on a small host that
// is usually CPU spent elsewhere: kernel threads (a memory monitor such as kdamond whose
// scans grow with the memory in use, kworkers finishing deferred teardown), other
// tenants. Only meaningful when the node runs on this machine.
type hostCPU struct {
	procRoot string
	// skip are the processes the CPUMeter already counts (the node, its data planes) and
	// the bench itself; cgroupParent is the sandboxes' parent cgroup, whose processes it
	// counts too: none of them is named as another process.
	skip         map[int]bool
	cgroupParent string
}

// hostReading is one reading of hostCPU's cumulative counters.
type hostReading struct {
	busy time.Duration // all CPUs: user, nice, system, irq, softirq, steal
	self time.Duration // this process (the bench), to leave out of busy
	// kthreads is each kernel thread group's CPU (by name up to its first '/': kworker,
	// ksoftirqd; kdamond.0 stays whole).
	kthreads map[string]time.Duration
	// procs is every other process's name and CPU, by pid.
	procs map[int]procTime
}

type procTime struct {
	name string
	cpu  time.Duration
}

// HostCPUCost is the machine's CPU per create over a block.
type HostCPUCost struct {
	// Busy is every CPU's busy time (the bench's own left out), per create: what the
	// machine spent, against the sources' Total.
	Busy time.Duration `json:"busy"`
	// KernelThreads is the kernel threads' share of Busy (their CPU is charged to no
	// cgroup and no process of the node's).
	KernelThreads time.Duration `json:"kernelThreads"`
	// TopKernelThread is the kernel thread group that used the most, and its CPU.
	TopKernelThread    string        `json:"topKernelThread,omitempty"`
	TopKernelThreadCPU time.Duration `json:"topKernelThreadCPU,omitempty"`
	// TopOther is the process outside the node, its data planes, its sandboxes and the
	// kernel threads that used the most (a host agent, another tenant), and its CPU.
	TopOther    string        `json:"topOther,omitempty"`
	TopOtherCPU time.Duration `json:"topOtherCPU,omitempty"`
}

func (h hostCPU) read() (hostReading, error) {
	var r hostReading
	raw, err := os.ReadFile(filepath.Join(h.procRoot, "stat"))
	if err != nil {
		return r, fmt.Errorf("bench: host cpu: %w", err)
	}
	if r.busy, err = parseStatBusy(raw); err != nil {
		return r, fmt.Errorf("bench: host cpu: %w", err)
	}
	var ts unix.Timespec
	if err := unix.ClockGettime(unix.CLOCK_PROCESS_CPUTIME_ID, &ts); err != nil {
		return r, fmt.Errorf("bench: own cpu clock: %w", err)
	}
	r.self = time.Duration(ts.Nano())
	if r.kthreads, err = kthreadCPU(h.procRoot); err != nil {
		return r, err
	}
	r.procs, err = h.otherCPU()
	return r, err
}

// otherCPU reads every process's CPU but the kernel threads and h.skip's.
func (h hostCPU) otherCPU() (map[int]procTime, error) {
	ents, err := os.ReadDir(h.procRoot)
	if err != nil {
		return nil, fmt.Errorf("bench: processes: %w", err)
	}
	out := map[int]procTime{}
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil || h.skip[pid] {
			continue
		}
		st, err := os.ReadFile(filepath.Join(h.procRoot, e.Name(), "stat"))
		if err != nil {
			continue
		}
		ps, ok := parseProcStat(st)
		if !ok || ps.pid == 2 || ps.ppid == 2 || h.skip[ps.ppid] {
			continue // kernel threads; the skipped processes' children count as theirs once reaped
		}
		out[pid] = procTime{name: ps.name, cpu: ps.cpu}
	}
	return out, nil
}

// inCgroup reports whether process pid is in the cgroup named parent or below it, in
// any hierarchy.
func (h hostCPU) inCgroup(pid int) bool {
	if h.cgroupParent == "" {
		return false
	}
	raw, err := os.ReadFile(filepath.Join(h.procRoot, strconv.Itoa(pid), "cgroup"))
	if err != nil {
		return true // gone: nothing to name
	}
	p := "/" + strings.Trim(h.cgroupParent, "/")
	for line := range strings.Lines(string(raw)) {
		// hierarchy-id:controllers:path
		parts := strings.SplitN(strings.TrimSpace(line), ":", 3)
		if len(parts) == 3 && (parts[2] == p || strings.HasPrefix(parts[2], p+"/")) {
			return true
		}
	}
	return false
}

// parseStatBusy sums the busy fields of /proc/stat's first line (all CPUs, in ticks):
// user, nice, system, irq, softirq, steal; guest time is already inside user.
func parseStatBusy(raw []byte) (time.Duration, error) {
	line, _, _ := bytes.Cut(raw, []byte("\n"))
	f := strings.Fields(string(line))
	if len(f) < 9 || f[0] != "cpu" {
		return 0, fmt.Errorf("malformed stat line %q", line)
	}
	var ticks int64
	for _, i := range []int{1, 2, 3, 6, 7, 8} { // user nice system (idle iowait) irq softirq steal
		v, err := strconv.ParseInt(f[i], 10, 64)
		if err != nil {
			return 0, fmt.Errorf("malformed stat line %q", line)
		}
		ticks += v
	}
	return time.Duration(ticks) * (time.Second / clockTick), nil
}

// kthreadCPU reads the CPU of kthreadd's children (every kernel thread), grouped by name.
// Threads that exited took their CPU with them, so this is a lower bound.
func kthreadCPU(procRoot string) (map[string]time.Duration, error) {
	raw, err := os.ReadFile(filepath.Join(procRoot, "2", "task", "2", "children"))
	if err != nil {
		return nil, fmt.Errorf("bench: kernel threads: %w", err)
	}
	out := map[string]time.Duration{}
	for _, pid := range strings.Fields(string(raw)) {
		st, err := os.ReadFile(filepath.Join(procRoot, pid, "stat"))
		if err != nil {
			continue // exited since the list was read
		}
		ps, ok := parseProcStat(st)
		if !ok {
			continue
		}
		group, _, _ := strings.Cut(ps.name, "/")
		out[group] += ps.cpu
	}
	return out, nil
}

// procStat is what hostCPU reads of a /proc/<pid>/stat line.
type procStat struct {
	pid, ppid int
	name      string
	cpu       time.Duration // utime + stime
}

// parseProcStat parses a /proc/<pid>/stat line. The command name is in parentheses and
// may hold spaces and parentheses: fields count from the last ')'.
func parseProcStat(st []byte) (procStat, bool) {
	open, end := bytes.IndexByte(st, '('), bytes.LastIndexByte(st, ')')
	if open < 0 || end < open {
		return procStat{}, false
	}
	pid, err0 := strconv.Atoi(strings.TrimSpace(string(st[:open])))
	// f[0] is field 3 (state), f[1] the parent, f[11] and f[12] utime and stime.
	f := strings.Fields(string(st[end+1:]))
	if len(f) < 13 {
		return procStat{}, false
	}
	ppid, err1 := strconv.Atoi(f[1])
	u, err2 := strconv.ParseInt(f[11], 10, 64)
	s, err3 := strconv.ParseInt(f[12], 10, 64)
	if err0 != nil || err1 != nil || err2 != nil || err3 != nil {
		return procStat{}, false
	}
	return procStat{pid: pid, ppid: ppid, name: string(st[open+1 : end]),
		cpu: time.Duration(u+s) * (time.Second / clockTick)}, true
}

// costSince is the machine's CPU per create from reading o to r over ops creates.
func (r hostReading) costSince(o hostReading, ops int) *HostCPUCost {
	if ops <= 0 {
		return nil
	}
	n := time.Duration(ops)
	c := &HostCPUCost{Busy: max(r.busy-o.busy-(r.self-o.self), 0) / n}
	var top time.Duration
	for name, cpu := range r.kthreads {
		d := cpu - o.kthreads[name]
		if d <= 0 {
			continue
		}
		c.KernelThreads += d
		if d > top || (d == top && name < c.TopKernelThread) {
			top, c.TopKernelThread = d, name
		}
	}
	c.KernelThreads /= n
	c.TopKernelThreadCPU = top / n
	return c
}

// topOther names the process outside h's sources that used the most CPU from reading o
// to r, with its CPU per create over ops; a process that started in between counts whole.
func (h hostCPU) topOther(o, r hostReading, ops int) (string, time.Duration) {
	type use struct {
		pid int
		d   time.Duration
	}
	var all []use
	for pid, p := range r.procs {
		d := p.cpu
		if q, ok := o.procs[pid]; ok && q.name == p.name {
			d -= q.cpu
		}
		if d > 0 {
			all = append(all, use{pid, d})
		}
	}
	sort.Slice(all, func(i, j int) bool { return all[i].d > all[j].d })
	// The sandboxes' processes are the most numerous; only the few largest are checked.
	for _, u := range all[:min(len(all), 64)] {
		if !h.inCgroup(u.pid) {
			return r.procs[u.pid].name, u.d / time.Duration(max(ops, 1))
		}
	}
	return "", 0
}
