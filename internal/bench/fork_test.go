package bench

import (
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"os/user"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/aenv-dev/aenv/internal/envd"
	"github.com/aenv-dev/aenv/internal/envd/identity"
	"github.com/aenv-dev/aenv/internal/envd/state"
)

// fakeNode answers the REST calls the benchmarks make and passes envd traffic to one
// real in-process envd (every "sandbox" shares it: commands run on this host).
type fakeNode struct {
	t   *testing.T
	url string

	mu       sync.Mutex
	seq      int
	live     map[string]bool
	forkErrs int             // children per fork answered with an error
	onResume func(id string) // called at each connect
	pauses   int
	memPause int // pauses with {"memory": true}
	forks    int
	// snapshots maps a live snapshot to the sandboxes created from it.
	snapshots map[string][]string
}

func newFakeNode(t *testing.T) *fakeNode {
	t.Helper()
	u, err := user.Current()
	if err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat("/bin/bash"); err != nil {
		t.Skip("needs /bin/bash")
	}
	dir := t.TempDir()
	pw, gr := filepath.Join(dir, "passwd"), filepath.Join(dir, "group")
	passwd := fmt.Sprintf("root:x:0:0:root:/root:/bin/sh\n%s:x:%s:%s::%s:/bin/sh\n", u.Username, u.Uid, u.Gid, dir)
	if u.Uid == "0" {
		passwd = "root:x:0:0:root:" + dir + ":/bin/sh\n"
	}
	if err := os.WriteFile(pw, []byte(passwd), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(gr, []byte("root:x:0:\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	ed := envd.New(envd.Config{Users: identity.DB{PasswdPath: pw, GroupPath: gr}, Defaults: state.New(u.Username), DiskPath: dir})
	n := &fakeNode{t: t, live: map[string]bool{}, snapshots: map[string][]string{}}
	hs := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if id := r.Header.Get("E2b-Sandbox-Id"); id != "" {
			n.mu.Lock()
			ok := n.live[id]
			n.mu.Unlock()
			if !ok {
				http.Error(w, "sandbox "+id+" is not running", http.StatusBadGateway)
				return
			}
			ed.ServeHTTP(w, r)
			return
		}
		n.rest(w, r)
	}))
	t.Cleanup(func() {
		ed.Process.SignalAll(9)
		hs.CloseClientConnections()
		hs.Close()
		ed.Close()
	})
	n.url = hs.URL
	return n
}

func (n *fakeNode) newID() string {
	n.seq++
	id := fmt.Sprintf("sbx%d", n.seq)
	n.live[id] = true
	return id
}

func (n *fakeNode) rest(w http.ResponseWriter, r *http.Request) {
	n.mu.Lock()
	defer n.mu.Unlock()
	parts := strings.Split(strings.Trim(r.URL.Path, "/"), "/")
	reply := func(code int, v any) {
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(code)
		if v != nil {
			json.NewEncoder(w).Encode(v)
		}
	}
	switch {
	case r.Method == http.MethodPost && r.URL.Path == "/v2/sandboxes":
		var body CreateRequest
		json.NewDecoder(r.Body).Decode(&body)
		id := n.newID()
		if kids, ok := n.snapshots[body.TemplateID]; ok {
			n.snapshots[body.TemplateID] = append(kids, id)
		}
		reply(http.StatusCreated, Sandbox{ID: id})
	case r.Method == http.MethodPost && len(parts) == 3 && parts[2] == "snapshots":
		n.seq++
		snap := fmt.Sprintf("snap%d", n.seq)
		n.snapshots[snap] = nil
		reply(http.StatusCreated, map[string]any{"snapshotID": snap, "names": []string{}})
	case r.Method == http.MethodDelete && len(parts) == 2 && parts[0] == "templates":
		for _, kid := range n.snapshots[parts[1]] {
			if n.live[kid] {
				n.t.Errorf("snapshot %s deleted while %s, created from it, runs", parts[1], kid)
			}
		}
		delete(n.snapshots, parts[1])
		w.WriteHeader(http.StatusNoContent)
	case r.Method == http.MethodGet && len(parts) == 2 && parts[0] == "sandboxes":
		reply(http.StatusOK, map[string]any{"sandboxID": parts[1], "memoryMB": 192})
	case r.Method == http.MethodDelete && len(parts) == 2:
		delete(n.live, parts[1])
		w.WriteHeader(http.StatusNoContent)
	case r.Method == http.MethodPost && len(parts) == 3 && parts[2] == "fork":
		var body struct{ Count int }
		json.NewDecoder(r.Body).Decode(&body)
		n.forks++
		out := make([]map[string]any, body.Count)
		for i := range out {
			if i < n.forkErrs {
				out[i] = map[string]any{"error": map[string]any{"code": 500, "message": "no slot"}}
				continue
			}
			out[i] = map[string]any{"sandbox": Sandbox{ID: n.newID()}}
		}
		reply(http.StatusCreated, out)
	case r.Method == http.MethodPost && len(parts) == 3 && parts[2] == "pause":
		var body map[string]bool
		if json.NewDecoder(r.Body).Decode(&body) != nil {
			reply(http.StatusBadRequest, map[string]string{"message": "bad body"})
			return
		}
		if body["memory"] {
			n.memPause++
		}
		n.pauses++
		n.live[parts[1]] = false
		w.WriteHeader(http.StatusNoContent)
	case r.Method == http.MethodPost && len(parts) == 3 && parts[2] == "connect":
		n.live[parts[1]] = true
		if n.onResume != nil {
			n.onResume(parts[1])
		}
		reply(http.StatusCreated, Sandbox{ID: parts[1]})
	default:
		reply(http.StatusNotFound, map[string]string{"message": "no route " + r.Method + " " + r.URL.Path})
	}
}

func TestRunFork(t *testing.T) {
	n := newFakeNode(t)
	c := NewClient(n.url, "key", 4)
	defer c.Close()
	r, err := RunFork(t.Context(), c, ForkOptions{Template: "base", Count: 3, Runs: 2, Warmup: 1})
	if err != nil {
		t.Fatal(err)
	}
	if r.Failures != 0 || r.AllAnswered.N != 2 || r.Fork.N != 2 || r.Child.N != 6 || n.forks != 3 {
		t.Fatalf("result %+v after %d forks", r, n.forks)
	}
	if r.AllAnswered.Min < r.Fork.Min || r.AllAnswered.Max < r.Child.Max {
		t.Fatalf("all answered (%v) is not the slowest child (%v) after the fork (%v)", r.AllAnswered, r.Child, r.Fork)
	}
	n.mu.Lock()
	for id, live := range n.live {
		if live {
			t.Errorf("sandbox %s left running", id)
		}
	}
	n.forkErrs = 1
	n.mu.Unlock()
	r, err = RunFork(t.Context(), c, ForkOptions{Template: "base", Count: 2, Runs: 2})
	if err != nil {
		t.Fatal(err)
	}
	if r.Failures != 2 || len(r.Errors) != 1 || !strings.Contains(r.Errors[0], "no slot") {
		t.Fatalf("failed children not reported: %+v", r)
	}
	var out strings.Builder
	if err := r.Write(&out, "table"); err != nil || !strings.Contains(out.String(), "all answered") ||
		!strings.Contains(out.String(), "2 of 2 runs had failures") {
		t.Fatalf("table: %v\n%s", err, out.String())
	}
}

func TestRunPause(t *testing.T) {
	n := newFakeNode(t)
	c := NewClient(n.url, "key", 2)
	defer c.Close()
	file := filepath.Join(t.TempDir(), "f")
	r, err := RunPause(t.Context(), c, PauseOptions{Template: "base", N: 3, Warmup: 1, File: file})
	if err != nil {
		t.Fatal(err)
	}
	if r.Failures != 0 || r.Pause.N != 3 || r.Resume.N != 3 || r.Command.N != 3 || n.pauses != 4 {
		t.Fatalf("result %+v after %d pauses", r, n.pauses)
	}
	// A resume that loses the file is a failed cycle.
	n.mu.Lock()
	n.onResume = func(string) { os.Remove(file) }
	n.mu.Unlock()
	r, err = RunPause(t.Context(), c, PauseOptions{Template: "base", N: 2, File: file})
	if err != nil {
		t.Fatal(err)
	}
	if r.Failures != 2 || len(r.Errors) == 0 || !strings.Contains(r.Errors[0], "after resume") {
		t.Fatalf("lost file not reported: %+v", r)
	}
	var out strings.Builder
	if err := r.Write(&out, "json"); err != nil || !strings.Contains(out.String(), `"failures": 2`) {
		t.Fatalf("json: %v\n%s", err, out.String())
	}
}

func TestBenchOptionsRejected(t *testing.T) {
	c := NewClient("http://127.0.0.1:1", "key", 1)
	defer c.Close()
	for _, o := range []ForkOptions{{Count: 0, Runs: 1}, {Count: 1, Runs: 0}, {Count: 1, Runs: 1, Warmup: -1}} {
		if _, err := RunFork(t.Context(), c, o); err == nil || !strings.Contains(err.Error(), "must be") {
			t.Errorf("RunFork(%+v) = %v, want an options error", o, err)
		}
	}
	for _, o := range []PauseOptions{{N: 0}, {N: 1, Warmup: -1}} {
		if _, err := RunPause(t.Context(), c, o); err == nil || !strings.Contains(err.Error(), "must be") {
			t.Errorf("RunPause(%+v) = %v, want an options error", o, err)
		}
	}
}

func TestRunForkPSS(t *testing.T) {
	n := newFakeNode(t)
	c := NewClient(n.url, "key", 4)
	defer c.Close()
	// The source is sbx1, the children sbx2 and sbx3: one QEMU each, plus a helper of sbx3.
	proc := t.TempDir()
	for pid, p := range map[string]struct{ cmdline, kb string }{
		"100": {"qemu\x00-pidfile\x00/d/sandboxes/sbx2/qemu.pid\x00", "30720"},
		"101": {"qemu\x00-pidfile\x00/d/sandboxes/sbx3/qemu.pid\x00", "20480"},
		"102": {"helper\x00sbx3\x00", "1024"},
		"103": {"qemu\x00-pidfile\x00/d/sandboxes/sbx1/qemu.pid\x00", "99999"},
	} {
		d := filepath.Join(proc, pid)
		os.MkdirAll(d, 0o755)
		os.WriteFile(filepath.Join(d, "cmdline"), []byte(p.cmdline), 0o644)
		os.WriteFile(filepath.Join(d, "smaps_rollup"), []byte("Rss: 1 kB\nPss: "+p.kb+" kB\n"), 0o644)
	}
	r, err := RunFork(t.Context(), c, ForkOptions{Template: "base", Count: 2, Runs: 1, PSS: true, Settle: 1, ProcRoot: proc})
	if err != nil {
		t.Fatal(err)
	}
	want := IdleMemory{Children: 2, TotalPSS: 51 << 20, PerChild: 51 << 19, GuestMB: 192, Overcommit: 384.0 / 51, Processes: 3}
	if r.Failures != 0 || r.Idle == nil || *r.Idle != want {
		t.Fatalf("idle memory %+v (failures %d: %v), want %+v", r.Idle, r.Failures, r.Errors, want)
	}
	var out strings.Builder
	if err := r.Write(&out, "table"); err != nil || !strings.Contains(out.String(), "7.5x overcommit") {
		t.Fatalf("table: %v\n%s", err, out.String())
	}
	// Children without processes here (a remote node): a failed run, not a figure.
	r, err = RunFork(t.Context(), c, ForkOptions{Template: "base", Count: 1, Runs: 1, PSS: true, Settle: 1, ProcRoot: t.TempDir()})
	if err != nil {
		t.Fatal(err)
	}
	if r.Failures != 1 || r.Idle != nil || !strings.Contains(r.Errors[0], "no process of child") {
		t.Fatalf("missing processes not reported: %+v", r)
	}
}

func TestRunSnapshot(t *testing.T) {
	n := newFakeNode(t)
	c := NewClient(n.url, "key", 2)
	defer c.Close()
	r, err := RunSnapshot(t.Context(), c, SnapshotOptions{Template: "base", N: 3, Warmup: 1})
	if err != nil {
		t.Fatal(err)
	}
	if r.Failures != 0 || r.Snapshot.N != 3 || r.Create.N != 3 || r.Command.N != 3 || r.Total.N != 3 {
		t.Fatalf("result %+v", r)
	}
	if r.Total.Min < r.Create.Min {
		t.Fatalf("total %v shorter than its create %v", r.Total, r.Create)
	}
	n.mu.Lock()
	defer n.mu.Unlock()
	if len(n.snapshots) != 0 {
		t.Errorf("snapshots left: %v", n.snapshots)
	}
	for id, live := range n.live {
		if live {
			t.Errorf("sandbox %s left running", id)
		}
	}
}

func TestRunPauseMemory(t *testing.T) {
	n := newFakeNode(t)
	c := NewClient(n.url, "key", 2)
	defer c.Close()
	r, err := RunPause(t.Context(), c, PauseOptions{Template: "base", N: 2, File: filepath.Join(t.TempDir(), "f"), KeepMemory: true})
	if err != nil {
		t.Fatal(err)
	}
	if r.Failures != 0 || !r.Memory || n.memPause != 2 {
		t.Fatalf("result %+v after %d pauses with memory", r, n.memPause)
	}
	var out strings.Builder
	if err := r.Write(&out, "table"); err != nil || !strings.Contains(out.String(), "pause (memory)") {
		t.Fatalf("table: %v\n%s", err, out.String())
	}
}

// RunCreate's sequential runs split off the client's share of each sample (before the
// create's request, between its answer and the command's request); concurrent runs do not.
func TestRunCreateClientShare(t *testing.T) {
	n := newFakeNode(t)
	c := NewClient(n.url, "key", 4)
	defer c.Close()
	for _, conc := range []int{1, 2} {
		r, err := RunCreate(t.Context(), c, CreateOptions{Template: "base", N: 4, Concurrency: conc, Warmup: 1})
		if err != nil {
			t.Fatal(err)
		}
		if r.Failures != 0 || r.Total.N != 4 {
			t.Fatalf("c=%d: %+v", conc, r)
		}
		switch {
		case conc == 1 && (r.Client.N != 4 || r.Client.Min <= 0 || r.Client.Max >= r.Total.Max):
			t.Errorf("c=1: client share %+v of total %+v", r.Client, r.Total)
		case conc > 1 && r.Client.N != 0:
			t.Errorf("c=%d: client share measured: %+v", conc, r.Client)
		}
	}
}

// A gap between sandboxes spaces a run's creates: every worker waits it after each of its
// sandboxes but the run's last, and a negative gap is refused.
func TestRunCreateGap(t *testing.T) {
	n := newFakeNode(t)
	c := NewClient(n.url, "key", 2)
	defer c.Close()
	const gap = 50 * time.Millisecond
	r, err := RunCreate(t.Context(), c, CreateOptions{Template: "base", N: 3, Concurrency: 1, Gap: gap})
	if err != nil {
		t.Fatal(err)
	}
	if r.Failures != 0 || r.Total.N != 3 || r.Wall < 2*gap {
		t.Fatalf("3 sandboxes with a gap of %v: %d failures, %d samples, wall %v", gap, r.Failures, r.Total.N, r.Wall)
	}
	if _, err := RunCreate(t.Context(), c, CreateOptions{Template: "base", N: 1, Concurrency: 1, Gap: -gap}); err == nil {
		t.Fatal("a negative gap was accepted")
	}
}

// A held run keeps every sandbox until all of them answered, then kills them all; without
// Hold each is killed before its worker reports it done, so at most the other worker's is
// alive then.
func TestRunCreateHold(t *testing.T) {
	for _, hold := range []bool{false, true} {
		n := newFakeNode(t)
		c := NewClient(n.url, "key", 2)
		peak := 0
		o := CreateOptions{Template: "base", N: 5, Concurrency: 2, Hold: hold, Progress: func(int, int) {
			n.mu.Lock()
			peak = max(peak, len(n.live))
			n.mu.Unlock()
		}}
		r, err := RunCreate(t.Context(), c, o)
		c.Close()
		if err != nil {
			t.Fatal(err)
		}
		n.mu.Lock()
		left := len(n.live)
		n.mu.Unlock()
		want := 1
		if hold {
			want = 5
		}
		if r.Failures != 0 || r.Total.N != 5 || left != 0 || peak > want || hold && peak != want {
			t.Errorf("hold %v: %d failures, %d samples, %d alive at most (want %d), %d left", hold, r.Failures, r.Total.N, peak, want, left)
		}
	}
}
