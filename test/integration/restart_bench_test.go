package integration

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"connectrpc.com/connect"

	"github.com/aenv-dev/aenv/internal/bench"
	"github.com/aenv-dev/aenv/internal/dataplane"
	"github.com/aenv-dev/aenv/internal/envd/gen/filesystem"
	"github.com/aenv-dev/aenv/internal/envd/gen/filesystem/filesystemconnect"
	"github.com/aenv-dev/aenv/internal/envdclient"
)

// BenchmarkRestartAdopt measures a node restart under load: AENV_BENCH_SANDBOXES sandboxes
// (default 20) run on the layered base, the node is killed with SIGKILL and started again,
// and the time is taken until its API answers (api-ms) and until every sandbox answers
// (all-ms: its envd, reached through the node's proxy, stats a file of its root disk).
// warm-all-ms is the same round on a node that did not restart: what answering costs on
// this host, restart or not. It also reports the data
// plane's resident memory with every sandbox running (dp-rss-mb) and its CPU use while
// the sandboxes idle (dp-idle-cpu-ms/s, over 10 s). api-cpu-ms and all-cpu-ms are the CPU
// time the new node process (and the children it waited for: nft, runc) had used by then:
// on a shared host they vary far less than the wall times. Run it with -bench RestartAdopt
// -benchtime 5x; AENV_BENCH_NODE_LOG=file keeps the node's log (with each start-up step's
// wall and CPU time), AENV_BENCH_PROFILE=dir a CPU profile of each restart.
func BenchmarkRestartAdopt(b *testing.B) {
	count := 20
	if s := os.Getenv("AENV_BENCH_SANDBOXES"); s != "" {
		var err error
		if count, err = strconv.Atoi(s); err != nil {
			b.Fatalf("AENV_BENCH_SANDBOXES=%q: %v", s, err)
		}
	}
	env := []string{"AENV_SANDBOX_SHUTDOWN_ACTION=stop", "AENV_SANDBOX_MAX_SANDBOXES=" + strconv.Itoa(count+16)}
	if count > 48 {
		// A test node's /24 holds 64 slots; this range is used by no other test.
		env = append(env, "AENV_NETWORK_SUBNET=10.94.0.0/20")
	}
	profDir := os.Getenv("AENV_BENCH_PROFILE")
	debug := ""
	if profDir != "" {
		// A CPU profile of each restart (the debug listener is up before the node opens).
		debug = fmt.Sprintf("127.0.0.1:%d", freePort(b))
		env = append(env, "AENV_DEBUG_LISTEN="+debug)
	}
	n := newNode(b, env...)
	n.start()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Minute)
	defer cancel()
	c := n.client()
	sbs := make([]bench.Sandbox, count)
	var wg sync.WaitGroup
	sem := make(chan struct{}, 4)
	for i := range sbs {
		wg.Add(1)
		sem <- struct{}{}
		go func() {
			defer func() { <-sem; wg.Done() }()
			sbs[i] = n.create(ctx, c)
		}()
	}
	wg.Wait()
	if len(loopDevices(n.dataDir)) == 0 {
		b.Skip("the base template is not layered on this host: no sandbox runs on a block root")
	}
	dp := dataplane.NewClient(dataplane.SocketPath(filepath.Join(n.dataDir, "dataplane")))
	st0, err := dp.Stats(ctx)
	if err != nil {
		b.Fatal(err)
	}
	time.Sleep(10 * time.Second)
	st1, err := dp.Stats(ctx)
	if err != nil {
		b.Fatal(err)
	}
	idle := float64((st1.CPU - st0.CPU).Milliseconds()) / 10
	hc := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 16}}
	var api, all, warm, apiCPU, allCPU []time.Duration
	for b.Loop() {
		start := time.Now()
		answerAll(ctx, b, hc, n.url(), sbs)
		warm = append(warm, time.Since(start))
		n.observe()
		n.kill9()
		hc.CloseIdleConnections()
		var prof sync.WaitGroup
		if profDir != "" {
			prof.Add(1)
			go func() {
				defer prof.Done()
				profileStart(b, debug, filepath.Join(profDir, fmt.Sprintf("restart-%d.pprof", len(api))))
			}()
		}
		start = time.Now()
		n.start()
		api = append(api, time.Since(start))
		apiCPU = append(apiCPU, cpuTime(b, n.pid()))
		answerAll(ctx, b, hc, n.url(), sbs)
		all = append(all, time.Since(start))
		allCPU = append(allCPU, cpuTime(b, n.pid()))
		prof.Wait()
	}
	b.ReportMetric(float64(median(api).Milliseconds()), "api-ms")
	b.ReportMetric(float64(median(all).Milliseconds()), "all-ms")
	b.ReportMetric(float64(median(warm).Milliseconds()), "warm-all-ms")
	b.ReportMetric(float64(median(apiCPU).Milliseconds()), "api-cpu-ms")
	b.ReportMetric(float64(median(allCPU).Milliseconds()), "all-cpu-ms")
	b.ReportMetric(float64(st1.RSSBytes)/(1<<20), "dp-rss-mb")
	b.ReportMetric(idle, "dp-idle-cpu-ms/s")
	b.ReportMetric(0, "ns/op")
	killAll(ctx, b, c)
	n.stop()
	if f := os.Getenv("AENV_BENCH_NODE_LOG"); f != "" {
		// The node's log, with its start-up timings, for a closer look at the restarts.
		if err := os.WriteFile(f, []byte(n.output()), 0o644); err != nil {
			b.Error(err)
		}
	}
}

// answerAll asks every sandbox's envd for the stat of a file on its root disk
// (filesystem.Stat through the node's proxy, as the SDKs reach envd), 16 at a time, and
// fails the benchmark for each sandbox that does not answer. Unlike a command (a login
// shell, ~30-100 ms of CPU each), it measures whether the node routes to the sandbox and
// its envd and root disk serve, not how fast the host forks bash.
func answerAll(ctx context.Context, b *testing.B, hc *http.Client, base string, sbs []bench.Sandbox) {
	var wg sync.WaitGroup
	sem := make(chan struct{}, 16)
	for _, sb := range sbs {
		wg.Add(1)
		sem <- struct{}{}
		go func() {
			defer func() { <-sem; wg.Done() }()
			envd := envdclient.New(hc, base, envdclient.WithSandbox(sb.ID, "49983"), envdclient.WithAccessToken(sb.Token))
			fs := filesystemconnect.NewFilesystemClient(hc, base, envd.ClientOptions()...)
			resp, err := fs.Stat(ctx, connect.NewRequest(&filesystem.StatRequest{Path: "/etc/os-release"}))
			if err != nil || resp.Msg.GetEntry().GetSize() == 0 {
				b.Errorf("sandbox %s does not answer: %v", sb.ID, err)
			}
		}()
	}
	wg.Wait()
}

// profileStart writes a 4-second CPU profile of the node starting, taken from its pprof
// listener at addr as soon as that answers.
func profileStart(b *testing.B, addr, path string) {
	for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); time.Sleep(5 * time.Millisecond) {
		resp, err := http.Get("http://" + addr + "/debug/pprof/profile?seconds=4")
		if err != nil {
			continue
		}
		defer resp.Body.Close()
		data, err := io.ReadAll(resp.Body)
		if err == nil {
			err = os.WriteFile(path, data, 0o644)
		}
		if err != nil {
			b.Error(err)
		}
		return
	}
	b.Errorf("no pprof listener at %s", addr)
}

// cpuTime is the CPU time the process pid and the children it waited for (runc, nft, ...)
// have used: unlike wall time on a shared host, it does not grow with the load.
func cpuTime(b *testing.B, pid int) time.Duration {
	data, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		b.Fatal(err)
	}
	// The fields after the command name (which may hold spaces) start at state (field 3).
	f := strings.Fields(string(data[bytes.LastIndexByte(data, ')')+2:]))
	var ticks int64
	for _, i := range []int{11, 12, 13, 14} { // utime, stime, cutime, cstime
		v, err := strconv.ParseInt(f[i], 10, 64)
		if err != nil {
			b.Fatalf("/proc/%d/stat: %v", pid, err)
		}
		ticks += v
	}
	return time.Duration(ticks) * 10 * time.Millisecond // USER_HZ is 100 on Linux
}

func median(ds []time.Duration) time.Duration {
	s := slices.Clone(ds)
	slices.Sort(s)
	return s[len(s)/2]
}
