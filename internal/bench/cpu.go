package bench

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"golang.org/x/sys/unix"
)

// CPUSources names what a CPU reading adds up on the node's machine: the node process
// (its own threads, and the children it waited for: runc, mkfs, nft...), the data-plane
// processes serving its layered roots, and the cgroup its sandboxes live under (each
// sandbox's cgroup is a child of it; the kernel charges a child's CPU to every ancestor,
// so the parent's counter keeps what sandboxes that are gone used).
type CPUSources struct {
	// ProcRoot and CgroupRoot default to /proc and /sys/fs/cgroup.
	ProcRoot   string
	CgroupRoot string
	NodePID    int
	// DataPlanePIDs are read like the node (their own CPU and their waited-for children).
	DataPlanePIDs []int
	// CgroupParent is the node's backend.cgroup_parent (e.g. "aenv"); empty: not read.
	CgroupParent string
}

// CPUReading is one reading of the cumulative counters.
type CPUReading struct {
	Node      time.Duration // the node's threads
	Children  time.Duration // the node's reaped children (runc, mkfs...)
	DataPlane time.Duration // the data planes with their reaped children
	Sandboxes time.Duration // the sandboxes' parent cgroup
}

// Helpers is the node's children and the data planes together.
func (r CPUReading) Helpers() time.Duration { return r.Children + r.DataPlane }

// Total is everything the reading covers.
func (r CPUReading) Total() time.Duration { return r.Node + r.Helpers() + r.Sandboxes }

// Sub is the CPU used between reading o and r.
func (r CPUReading) Sub(o CPUReading) CPUReading {
	return CPUReading{Node: r.Node - o.Node, Children: r.Children - o.Children, DataPlane: r.DataPlane - o.DataPlane,
		Sandboxes: r.Sandboxes - o.Sandboxes}
}

func (r CPUReading) add(o CPUReading) CPUReading {
	return CPUReading{Node: r.Node + o.Node, Children: r.Children + o.Children, DataPlane: r.DataPlane + o.DataPlane,
		Sandboxes: r.Sandboxes + o.Sandboxes}
}

// CPUMeter reads the counters of its sources.
type CPUMeter struct {
	src CPUSources
	// cgroupFile is the sandboxes' parent counter: cpu.stat (unified hierarchy, µs) or
	// cpuacct.usage (v1, ns).
	cgroupFile string
	unified    bool
	// precise reads the processes' CPU clocks (procCPU): the host's own /proc.
	precise bool
}

// clockTick is USER_HZ, the unit of /proc/<pid>/stat's times: 100 on every Linux ABI Go
// supports (the kernel exports it as a constant, not the configured HZ).
const clockTick = 100

// NewCPUMeter checks that every source can be read.
func NewCPUMeter(src CPUSources) (*CPUMeter, error) {
	if src.ProcRoot == "" {
		src.ProcRoot = "/proc"
	}
	if src.CgroupRoot == "" {
		src.CgroupRoot = "/sys/fs/cgroup"
	}
	if src.NodePID <= 0 {
		return nil, fmt.Errorf("bench: cpu: no node process id")
	}
	m := &CPUMeter{src: src, precise: src.ProcRoot == "/proc"}
	if p := strings.Trim(src.CgroupParent, "/"); p != "" {
		v2 := filepath.Join(src.CgroupRoot, p, "cpu.stat")
		v1 := filepath.Join(src.CgroupRoot, "cpuacct", p, "cpuacct.usage")
		switch {
		case fileExists(filepath.Join(src.CgroupRoot, "cgroup.controllers")):
			m.cgroupFile, m.unified = v2, true
		case fileExists(v1):
			m.cgroupFile = v1
		default:
			m.cgroupFile, m.unified = v2, true
		}
	}
	if _, err := m.Read(); err != nil {
		return nil, err
	}
	return m, nil
}

func fileExists(p string) bool { _, err := os.Stat(p); return err == nil }

// Sources returns what the meter reads.
func (m *CPUMeter) Sources() CPUSources { return m.src }

// Read takes one reading. A sandboxes' cgroup that does not exist yet reads as zero (the
// backend makes it with the first sandbox).
func (m *CPUMeter) Read() (CPUReading, error) {
	var r CPUReading
	self, children, err := procCPU(m.src.ProcRoot, m.src.NodePID, m.precise)
	if err != nil {
		return r, err
	}
	r.Node, r.Children = self, children
	for _, pid := range m.src.DataPlanePIDs {
		s, c, err := procCPU(m.src.ProcRoot, pid, m.precise)
		if err != nil {
			return r, err
		}
		r.DataPlane += s + c
	}
	if m.cgroupFile != "" {
		d, err := cgroupCPU(m.cgroupFile, m.unified)
		if err != nil && !errors.Is(err, os.ErrNotExist) {
			return r, err
		}
		r.Sandboxes = d
	}
	return r, nil
}

// Quiesce waits until the sources have stopped using CPU (work the node does in the
// background after answering, such as refilling its warm pools, belongs to the operation
// that caused it), at most limit, and returns the last reading.
func (m *CPUMeter) Quiesce(ctx context.Context, limit time.Duration) (CPUReading, error) {
	const step, idle = 100 * time.Millisecond, 2 * time.Millisecond
	prev, err := m.Read()
	if err != nil {
		return prev, err
	}
	for deadline := time.Now().Add(limit); time.Now().Before(deadline); {
		if err := sleepCtx(ctx, step); err != nil {
			return prev, err
		}
		cur, err := m.Read()
		if err != nil {
			return cur, err
		}
		if cur.Sub(prev).Total() <= idle {
			return cur, nil
		}
		prev = cur
	}
	return prev, nil
}

// procCPU reads the CPU of pid's threads, dead ones included (self), and of its children
// it has waited for (children). Both come from /proc/<pid>/stat, in ticks of 10 ms; with
// precise, self is the process's CPU clock instead (clock_gettime of CPUCLOCK_SCHED for
// pid, nanoseconds): a fork child's share of the node's CPU is well under a tick, so a
// run of 16 moved by 0.6 ms per child with one tick more or less. Only for pids of the
// caller's pid namespace (the clock takes the pid as the kernel sees it).
func procCPU(procRoot string, pid int, precise bool) (self, children time.Duration, err error) {
	raw, err := os.ReadFile(filepath.Join(procRoot, strconv.Itoa(pid), "stat"))
	if err != nil {
		return 0, 0, fmt.Errorf("bench: cpu of process %d: %w", pid, err)
	}
	// The command name (field 2) is in parentheses and may hold spaces: fields count
	// from the last ')'.
	i := bytes.LastIndexByte(raw, ')')
	if i < 0 {
		return 0, 0, fmt.Errorf("bench: cpu of process %d: malformed stat", pid)
	}
	f := strings.Fields(string(raw[i+1:]))
	// f[0] is field 3 (state); utime, stime, cutime, cstime are fields 14-17.
	if len(f) < 15 {
		return 0, 0, fmt.Errorf("bench: cpu of process %d: stat has %d fields", pid, len(f)+2)
	}
	var t [4]int64
	for k := range t {
		if t[k], err = strconv.ParseInt(f[11+k], 10, 64); err != nil {
			return 0, 0, fmt.Errorf("bench: cpu of process %d: %w", pid, err)
		}
	}
	tick := time.Second / clockTick
	self, children = time.Duration(t[0]+t[1])*tick, time.Duration(t[2]+t[3])*tick
	if precise {
		var ts unix.Timespec
		// MAKE_PROCESS_CPUCLOCK(pid, CPUCLOCK_SCHED) of the kernel's posix-timers.h.
		if err := unix.ClockGettime(int32(^pid<<3|2), &ts); err != nil {
			return 0, 0, fmt.Errorf("bench: cpu clock of process %d: %w", pid, err)
		}
		self = time.Duration(ts.Nano())
	}
	return self, children, nil
}

// cgroupCPU reads a cgroup's cumulative CPU: usage_usec of cpu.stat, or cpuacct.usage.
func cgroupCPU(path string, unified bool) (time.Duration, error) {
	raw, err := os.ReadFile(path)
	if err != nil {
		return 0, fmt.Errorf("bench: cpu of cgroup: %w", err)
	}
	if !unified {
		ns, err := strconv.ParseInt(strings.TrimSpace(string(raw)), 10, 64)
		if err != nil {
			return 0, fmt.Errorf("bench: %s: %w", path, err)
		}
		return time.Duration(ns), nil
	}
	sc := bufio.NewScanner(bytes.NewReader(raw))
	for sc.Scan() {
		if k, v, ok := strings.Cut(sc.Text(), " "); ok && k == "usage_usec" {
			us, err := strconv.ParseInt(v, 10, 64)
			if err != nil {
				return 0, fmt.Errorf("bench: %s: %w", path, err)
			}
			return time.Duration(us) * time.Microsecond, nil
		}
	}
	return 0, fmt.Errorf("bench: %s has no usage_usec", path)
}

// CPUCost is the CPU an operation used on the node's machine, per operation: the
// counters' difference over a run divided by its operations.
type CPUCost struct {
	Ops   int           `json:"ops"`
	Total time.Duration `json:"total"`
	Node  time.Duration `json:"node"`
	// Helpers is Runtime (the node's reaped children: runc...) + DataPlane.
	Helpers   time.Duration `json:"helpers"`
	Runtime   time.Duration `json:"runtime"`
	DataPlane time.Duration `json:"dataPlane"`
	Sandboxes time.Duration `json:"sandboxes"`
}

// costOf divides the CPU d used over ops operations.
func costOf(d CPUReading, ops int) *CPUCost {
	if ops <= 0 {
		return nil
	}
	n := time.Duration(ops)
	return &CPUCost{Ops: ops, Total: d.Total() / n, Node: d.Node / n, Helpers: d.Helpers() / n,
		Runtime: d.Children / n, DataPlane: d.DataPlane / n, Sandboxes: d.Sandboxes / n}
}

// medianCost is the cost with the median total among costs (nil ones skipped).
func medianCost(costs []*CPUCost) *CPUCost {
	var v []*CPUCost
	for _, c := range costs {
		if c != nil {
			v = append(v, c)
		}
	}
	if len(v) == 0 {
		return nil
	}
	// Insertion sort: a handful of runs.
	for i := 1; i < len(v); i++ {
		for j := i; j > 0 && v[j].Total < v[j-1].Total; j-- {
			v[j], v[j-1] = v[j-1], v[j]
		}
	}
	m := *v[(len(v)-1)/2]
	return &m
}

// cpuMs formats a per-operation CPU figure ("-" when not measured).
func cpuMs(c *CPUCost) string {
	if c == nil {
		return "-"
	}
	return ms(c.Total)
}

// quiesceLimit bounds how long a run waits for the node to go idle before and after it.
const quiesceLimit = 3 * time.Second

// cpuPhases adds up the CPU of named phases of sequential cycles: start() begins a
// phase, mark(name) ends it and charges it to name. A nil *cpuPhases does nothing.
type cpuPhases struct {
	m    *CPUMeter
	last CPUReading
	sums map[string]CPUReading
	err  error
}

func newCPUPhases(m *CPUMeter) *cpuPhases {
	if m == nil {
		return nil
	}
	return &cpuPhases{m: m, sums: map[string]CPUReading{}}
}

func (p *cpuPhases) start() {
	if p == nil {
		return
	}
	r, err := p.m.Read()
	if err != nil && p.err == nil {
		p.err = err
	}
	p.last = r
}

func (p *cpuPhases) mark(name string) {
	if p == nil {
		return
	}
	last := p.last
	p.start()
	p.sums[name] = p.sums[name].add(p.last.Sub(last))
}

// cost is phase name's CPU per operation over ops operations (nil when not measured).
func (p *cpuPhases) cost(name string, ops int) *CPUCost {
	if p == nil || p.err != nil {
		return nil
	}
	return costOf(p.sums[name], ops)
}

// cpuWindow measures the CPU of a whole run: begin waits for the node to go idle and
// reads, end does the same and gives the CPU per operation. A nil meter measures nothing.
type cpuWindow struct {
	m      *CPUMeter
	before CPUReading
	err    error
}

func beginCPU(ctx context.Context, m *CPUMeter) *cpuWindow {
	if m == nil {
		return nil
	}
	w := &cpuWindow{m: m}
	w.before, w.err = m.Quiesce(ctx, quiesceLimit)
	return w
}

func (w *cpuWindow) end(ctx context.Context, ops int) *CPUCost {
	if w == nil || w.err != nil {
		return nil
	}
	after, err := w.m.Quiesce(ctx, quiesceLimit)
	if err != nil {
		return nil
	}
	return costOf(after.Sub(w.before), ops)
}

// cpuRow is one row of a CPU table.
type cpuRow struct {
	name string
	c    *CPUCost
}

// writeCPU prints a table of CPU per operation, split by source; nothing when no row was
// measured.
func writeCPU(w io.Writer, rows []cpuRow) error {
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', tabwriter.AlignRight)
	header := false
	for _, r := range rows {
		if r.c == nil {
			continue
		}
		if !header {
			fmt.Fprintln(w)
			fmt.Fprintln(tw, "cpu per operation\tops\ttotal\tnode\truntime\tdata plane\tsandboxes\t")
			header = true
		}
		fmt.Fprintf(tw, "%s\t%d\t%s\t%s\t%s\t%s\t%s\t\n", r.name, r.c.Ops, ms(r.c.Total), ms(r.c.Node), ms(r.c.Runtime), ms(r.c.DataPlane), ms(r.c.Sandboxes))
	}
	return tw.Flush()
}
