package microvm

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"os"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/aenv-dev/aenv/internal/sandbox"
)

// counterScript starts a background counter whose value lives only in the shell's memory
// (a restarted process would begin again at 1) and is written to /tmp/count every 100 ms
// (renamed into place: a reader never sees the file truncated).
const counterScript = `rm -f /tmp/counter.pid /tmp/count
setsid bash -c 'echo $$ > /tmp/counter.pid; i=0; while :; do i=$((i+1)); echo $i > /tmp/count.new; mv /tmp/count.new /tmp/count; sleep 0.1; done' >/dev/null 2>&1 < /dev/null &
n=0; while [ ! -s /tmp/count ] && [ $n -lt 300 ]; do sleep 0.1; n=$((n+1)); done; cat /tmp/counter.pid`

// counterState reads the counter's pid, whether that process still runs, and its value.
func counterState(t testing.TB, i *Instance) (pid string, running bool, value int) {
	t.Helper()
	out := mustSh(t, i, `p=$(cat /tmp/counter.pid); echo $p; if kill -0 $p 2>/dev/null; then echo yes; else echo no; fi; cat /tmp/count`)
	f := strings.Fields(out)
	if len(f) != 3 {
		t.Fatalf("%s: counter state %q", i.id, out)
	}
	v, err := strconv.Atoi(f[2])
	if err != nil {
		t.Fatalf("%s: counter value %q", i.id, f[2])
	}
	return f[0], f[1] == "yes", v
}

// TestForkKeepsProcesses: a counter started before a snapshot runs on in each of 4 forks,
// from the value it had (not from 1), as the same process, and the forks' memory and
// disks are their own; the source keeps running. Also reports the forks' PSS against
// 4 × guest RAM.
func TestForkKeepsProcesses(t *testing.T) {
	b := newTestBackend(t)
	ctx := context.Background()
	src := launch(t, b, "sbx-fsrc", sandbox.Resources{CPUCount: 1, MemoryMB: testMemMB, DiskSizeMB: templateMB})
	pid := strings.TrimSpace(mustSh(t, src, counterScript))
	time.Sleep(time.Second)
	_, _, before := counterState(t, src)
	if before < 3 {
		t.Fatalf("counter at %d after 1.5 s", before)
	}
	mustSh(t, src, `echo source > /root/mark; echo source > /tmp/memmark`)

	const n = 4
	specs := make([]sandbox.ForkSpec, n)
	for k := range specs {
		specs[k] = sandbox.ForkSpec{SandboxID: fmt.Sprintf("sbx-fork%d", k)}
	}
	t0 := time.Now()
	res, err := src.Fork(ctx, specs)
	if err != nil {
		t.Fatal(err)
	}
	forkTime := time.Since(t0)
	forks := make([]*Instance, n)
	for k, r := range res {
		if r.Err != nil {
			t.Fatalf("fork %d: %v", k, r.Err)
		}
		forks[k] = r.Instance.(*Instance)
	}
	var wg sync.WaitGroup
	for _, f := range forks {
		wg.Add(1)
		go func() { defer wg.Done(); waitEnvdErr(t, f) }()
	}
	wg.Wait()
	t.Logf("fork %d: Fork returned in %v, all envd answering in %v", n, forkTime.Round(time.Millisecond), time.Since(t0).Round(time.Millisecond))
	if t.Failed() {
		t.FailNow()
	}

	for k, f := range forks {
		fpid, running, v := counterState(t, f)
		if fpid != pid || !running {
			t.Errorf("fork %d: counter pid %s running=%v, want pid %s running", k, fpid, running, pid)
		}
		if v < before {
			t.Errorf("fork %d: counter at %d, below %d before the snapshot: the process restarted", k, v, before)
		}
		if got := strings.TrimSpace(mustSh(t, f, `cat /root/mark /tmp/memmark`)); got != "source\nsource" {
			t.Errorf("fork %d: inherited marks %q", k, got)
		}
		mustSh(t, f, fmt.Sprintf(`echo fork%d > /root/mark; echo fork%d > /tmp/memmark`, k, k))
	}
	// The counter keeps counting in each fork independently.
	time.Sleep(500 * time.Millisecond)
	for k, f := range forks {
		want := fmt.Sprintf("fork%d\nfork%d", k, k)
		if got := strings.TrimSpace(mustSh(t, f, `cat /root/mark /tmp/memmark`)); got != want {
			t.Errorf("fork %d: marks %q, want %q: disks or memory are shared", k, got, want)
		}
		_, running, v := counterState(t, f)
		if !running || v <= before {
			t.Errorf("fork %d: counter running=%v at %d", k, running, v)
		}
	}
	if got := strings.TrimSpace(mustSh(t, src, `cat /root/mark /tmp/memmark`)); got != "source\nsource" {
		t.Errorf("source marks %q after the forks wrote theirs", got)
	}

	var pss, rss int64
	for _, f := range forks {
		p, r := smapsRollup(t, f.PID())
		pss += p
		rss += r
	}
	t.Logf("PSS of %d idle forks: %d MiB in total (RSS %d MiB) vs %d × %d MiB guest RAM = %d MiB",
		n, pss>>20, rss>>20, n, testMemMB, n*testMemMB)
}

// TestPauseResumeKeepsProcess: pause ends the VM, resume brings back the same process
// with its memory, and a second pause/resume cycle works on the resumed VM.
func TestPauseResumeKeepsProcess(t *testing.T) {
	b := newTestBackend(t)
	ctx := context.Background()
	id := "sbx-pause"
	i := launch(t, b, id, sandbox.Resources{CPUCount: 1, MemoryMB: testMemMB, DiskSizeMB: templateMB})
	pid := strings.TrimSpace(mustSh(t, i, counterScript))
	mustSh(t, i, `echo kept > /tmp/memmark; echo kept > /root/mark`)
	for round := range 2 {
		_, _, before := counterState(t, i)
		qpid := i.PID()
		t0 := time.Now()
		ps, err := i.Pause(ctx, sandbox.PauseOptions{KeepMemory: true})
		if err != nil {
			t.Fatal(err)
		}
		pauseTime := time.Since(t0)
		if _, err := os.Stat(fmt.Sprintf("/proc/%d", qpid)); err == nil {
			t.Fatalf("QEMU %d still runs after Pause", qpid)
		}
		raw, err := ps.Encode()
		if err != nil {
			t.Fatal(err)
		}
		decoded, err := b.DecodePaused(raw)
		if err != nil {
			t.Fatal(err)
		}
		t1 := time.Now()
		inst, err := b.Launch(ctx, sandbox.LaunchPlan{Kind: sandbox.LaunchResume, SandboxID: id, Paused: decoded})
		if err != nil {
			t.Fatal(err)
		}
		i = inst.(*Instance)
		waitEnvd(t, i)
		t.Logf("round %d: pause %v, resume → envd answering %v", round, pauseTime.Round(time.Millisecond), time.Since(t1).Round(time.Millisecond))
		gotPID, running, v := counterState(t, i)
		if gotPID != pid || !running || v < before {
			t.Errorf("round %d: counter pid %s running=%v value %d; want pid %s running from ≥ %d", round, gotPID, running, v, pid, before)
		}
		if got := strings.TrimSpace(mustSh(t, i, `cat /tmp/memmark /root/mark`)); got != "kept\nkept" {
			t.Errorf("round %d: marks %q", round, got)
		}
	}
}

func waitEnvdErr(t testing.TB, i *Instance) {
	if err := envdReady(i, 60*time.Second); err != nil {
		console, _ := os.ReadFile(i.ConsoleLog())
		t.Errorf("envd of %s: %v; console:\n%s", i.id, err, console)
	}
}

// smapsRollup returns a process's proportional and resident set sizes in bytes.
func smapsRollup(t testing.TB, pid int) (pss, rss int64) {
	t.Helper()
	raw, err := os.ReadFile(fmt.Sprintf("/proc/%d/smaps_rollup", pid))
	if err != nil {
		t.Fatal(err)
	}
	sc := bufio.NewScanner(bytes.NewReader(raw))
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		if len(f) < 2 {
			continue
		}
		v, _ := strconv.ParseInt(f[1], 10, 64)
		switch f[0] {
		case "Pss:":
			pss = v << 10
		case "Rss:":
			rss = v << 10
		}
	}
	return pss, rss
}
