package microvm

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/aenv-dev/aenv/internal/sandbox"
)

// BenchmarkFork16: one capture and 16 children restored on its RAM file, until every
// child's envd answers (all-envd-ms); once the children have idled forkSettle, their total
// PSS against 16 × guest RAM (pss-MiB, overcommit-x: the overcommit an idle fork fleet
// allows) and where an idle fork's PSS goes (MiB per fork, see forkMemory); then a first
// command in every child at once (firstCommand; all-cmd-ms: fork → all 16 done, the idle
// pause left out; qemu-cpu-ms: the CPU time the 16 QEMUs spent on it all, idling left
// out) and their PSS 2 s after it (pss-cmd-MiB). Guests of 128, 256 and 512 MiB; every
// figure is the median of the rounds (-benchtime=3x for three). AENV_BENCH_TB_SIZE_MIB
// sets Config.TBSizeMiB.
func BenchmarkFork16(b *testing.B) {
	tb, _ := strconv.Atoi(os.Getenv("AENV_BENCH_TB_SIZE_MIB"))
	for _, mem := range []int{128, 256, 512} {
		b.Run(fmt.Sprintf("%dMiB", mem), func(b *testing.B) { benchFork16(b, mem, tb) })
	}
}

// forkSettle is how long the children idle before their memory is read: past the first
// seconds after a restore, in which the guest still runs code for the first time.
const forkSettle = 12 * time.Second

func benchFork16(b *testing.B, memMB, tbMiB int) {
	be := newTestBackend(b, func(c *Config) { c.Network.PoolSize = 0; c.TBSizeMiB = tbMiB })
	ctx := context.Background()
	src := launch(b, be, "sbx-f16", sandbox.Resources{CPUCount: 1, MemoryMB: memMB, DiskSizeMB: templateMB})
	const n = 16
	var forkT, allT, cmdT, cpuT []time.Duration
	var pss, pssCmd []int64
	var parts []forkMemory
	round := 0
	for b.Loop() {
		specs := make([]sandbox.ForkSpec, n)
		for k := range specs {
			specs[k] = sandbox.ForkSpec{SandboxID: fmt.Sprintf("sbx-f16-%d-%d", round, k)}
		}
		round++
		t0 := time.Now()
		res, err := src.Fork(ctx, specs)
		if err != nil {
			b.Fatal(err)
		}
		forkT = append(forkT, time.Since(t0))
		for _, r := range res {
			if r.Err != nil {
				b.Fatal(r.Err)
			}
		}
		for _, r := range res {
			if err := envdReady(r.Instance.(*Instance), 120*time.Second); err != nil {
				b.Fatal(err)
			}
		}
		envdDone := time.Since(t0)
		allT = append(allT, envdDone)
		cpuEnvd := forksCPU(res)
		b.StopTimer()
		time.Sleep(forkSettle)
		cpuIdle := forksCPU(res) - cpuEnvd
		var sum forkMemory
		var total int64
		for _, r := range res {
			m, err := readForkMemory(r.Instance.(*Instance).PID(), int64(memMB)<<20)
			if err != nil {
				b.Fatal(err)
			}
			total += m.total()
			sum = sum.add(m)
		}
		pss = append(pss, total)
		parts = append(parts, sum)
		b.StartTimer()
		t1 := time.Now()
		var wg sync.WaitGroup
		errs := make([]error, len(res))
		for k, r := range res {
			wg.Go(func() { _, errs[k] = firstCommandErr(r.Instance.(*Instance)) })
		}
		wg.Wait()
		if err := errors.Join(errs...); err != nil {
			b.Fatal(err)
		}
		cmdT = append(cmdT, envdDone+time.Since(t1))
		cpuT = append(cpuT, forksCPU(res)-cpuIdle)
		b.StopTimer()
		time.Sleep(2 * time.Second)
		total = 0
		for _, r := range res {
			p, _ := smapsRollup(b, r.Instance.(*Instance).PID())
			total += p
		}
		pssCmd = append(pssCmd, total)
		for _, r := range res {
			stopRetry(b, r.Instance)
		}
		b.StartTimer()
	}
	b.ReportMetric(medianMS(forkT), "fork-ms")
	b.ReportMetric(medianMS(allT), "all-envd-ms")
	b.ReportMetric(medianMS(cmdT), "all-cmd-ms")
	b.ReportMetric(medianMS(cpuT), "qemu-cpu-ms")
	total := medianInt(pss)
	b.ReportMetric(float64(total)/(1<<20), "pss-MiB")
	b.ReportMetric(float64(n*memMB)/(float64(total)/(1<<20)), "overcommit-x")
	b.ReportMetric(float64(medianInt(pssCmd))/(1<<20), "pss-cmd-MiB")
	perFork := func(f func(forkMemory) int64) float64 {
		v := make([]int64, len(parts))
		for k, p := range parts {
			v[k] = f(p)
		}
		return float64(medianInt(v)) / n / (1 << 20)
	}
	b.ReportMetric(perFork(func(m forkMemory) int64 { return m.code }), "tcg-code-MiB/fork")
	b.ReportMetric(perFork(func(m forkMemory) int64 { return m.qemuAnon }), "qemu-anon-MiB/fork")
	b.ReportMetric(perFork(func(m forkMemory) int64 { return m.files }), "qemu-files-MiB/fork")
	b.ReportMetric(perFork(func(m forkMemory) int64 { return m.guestPrivate }), "guest-private-MiB/fork")
	b.ReportMetric(perFork(func(m forkMemory) int64 { return m.guestShared }), "guest-shared-MiB/fork")
}

// forksCPU is the CPU time (user + system) the children's QEMUs have spent.
func forksCPU(res []sandbox.ForkResult) time.Duration {
	var cpu time.Duration
	for _, r := range res {
		if ticks, _, err := procUsage(r.Instance.(*Instance).PID()); err == nil {
			cpu += time.Duration(ticks) * time.Second / clockTicks
		}
	}
	return cpu
}

func medianInt(v []int64) int64 {
	if len(v) == 0 {
		return 0
	}
	s := slices.Clone(v)
	slices.Sort(s)
	return s[len(s)/2]
}

// forkMemory is a QEMU process's PSS (bytes) by where it goes: code is TCG's translation
// cache (the one anonymous executable mapping), qemuAnon QEMU's other anonymous memory
// (heap, thread stacks, mmap'd allocations), files its binaries and libraries (their
// relocated data is private), guestPrivate the guest pages it wrote since the restore
// (copies of the RAM file's pages) and guestShared its share of the RAM file's pages it
// only read.
type forkMemory struct {
	code, qemuAnon, files, guestPrivate, guestShared int64
}

func (m forkMemory) total() int64 {
	return m.code + m.qemuAnon + m.files + m.guestPrivate + m.guestShared
}

func (m forkMemory) add(o forkMemory) forkMemory {
	return forkMemory{m.code + o.code, m.qemuAnon + o.qemuAnon, m.files + o.files,
		m.guestPrivate + o.guestPrivate, m.guestShared + o.guestShared}
}

// readForkMemory reads /proc/pid/smaps. The guest's RAM is the file mapping of ramBytes.
func readForkMemory(pid int, ramBytes int64) (forkMemory, error) {
	raw, err := os.ReadFile(fmt.Sprintf("/proc/%d/smaps", pid))
	if err != nil {
		return forkMemory{}, err
	}
	var m forkMemory
	kind := ""
	sc := bufio.NewScanner(bytes.NewReader(raw))
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		if len(f) < 2 {
			continue
		}
		if !strings.HasSuffix(f[0], ":") { // a mapping's header: range perms offset dev inode [path]
			var lo, hi uint64
			if _, err := fmt.Sscanf(f[0], "%x-%x", &lo, &hi); err != nil || len(f) < 5 {
				return forkMemory{}, fmt.Errorf("smaps of %d: bad line %q", pid, sc.Text())
			}
			switch {
			case f[4] != "0" && int64(hi-lo) == ramBytes:
				kind = "ram"
			case f[4] != "0":
				kind = "file"
			case strings.Contains(f[1], "x"):
				kind = "code"
			default:
				kind = "anon"
			}
			continue
		}
		v, _ := strconv.ParseInt(f[1], 10, 64)
		v <<= 10
		switch {
		case f[0] == "Pss:" && kind == "ram":
			m.guestShared += v
		case f[0] == "Private_Dirty:" && kind == "ram":
			m.guestShared -= v
			m.guestPrivate += v
		case f[0] == "Pss:" && kind == "file":
			m.files += v
		case f[0] == "Pss:" && kind == "code":
			m.code += v
		case f[0] == "Pss:" && kind == "anon":
			m.qemuAnon += v
		}
	}
	return m, sc.Err()
}
