package integration

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/aenv-dev/aenv/internal/bench"
)

// The microvm node: `aenv serve` with backend.kind = microvm (a QEMU microVM per sandbox,
// TCG here) on the data plane, as a node runs it. Guests are small (192 MiB): touching
// memory under TCG is slow.

// microvmNode prepares a microvm node, or skips saying what the host lacks.
func microvmNode(t *testing.T, env ...string) *node {
	t.Helper()
	needNode(t)
	if _, err := exec.LookPath("qemu-system-x86_64"); err != nil {
		t.Skip("needs qemu-system-x86_64 (Debian package qemu-system-x86)")
	}
	root, err := repoRoot()
	if err != nil {
		t.Fatal(err)
	}
	guest := filepath.Join(root, "bin", "microvm")
	for _, f := range []string{"vmlinux", "initrd.img"} {
		if _, err := os.Stat(filepath.Join(guest, f)); err != nil {
			t.Skipf("needs the microVM guest (make guest): %v", err)
		}
	}
	n := newNode(t, append([]string{
		"AENV_BACKEND_KIND=microvm", "AENV_BACKEND_ACCEL=tcg",
		"AENV_BACKEND_GUEST_KERNEL=" + filepath.Join(guest, "vmlinux"),
		"AENV_BACKEND_GUEST_INITRD=" + filepath.Join(guest, "initrd.img"),
		"AENV_SANDBOX_DEFAULT_MEMORY_MB=192", "AENV_SANDBOX_DEFAULT_CPU=1",
		// A cold boot under TCG on a busy 2-CPU machine can take tens of seconds.
		"AENV_ENVD_READY_TIMEOUT=180s",
		"AENV_SANDBOX_SHUTDOWN_ACTION=stop",
	}, env...)...)
	// The RAM files live in tmpfs, outside the data dir; QEMU processes are killed by
	// the node's cleanup (they name the data dir).
	t.Cleanup(func() { os.RemoveAll(n.ramDir()) })
	return n
}

// ramDir is the microvm backend's directory of guest RAM files (its default: one per
// data dir, in /dev/shm).
func (n *node) ramDir() string {
	sum := sha256.Sum256([]byte(filepath.Join(n.dataDir, "microvm")))
	return "/dev/shm/aenv-microvm-" + hex.EncodeToString(sum[:4])
}

// qemuPids maps each QEMU process of n's microvm backend to the sandbox its directory's
// state names (a pooled VM keeps its pool directory when handed out), or to the directory.
func (n *node) qemuPids() map[int]string {
	dir := filepath.Join(n.dataDir, "microvm", "sandboxes") + "/"
	out := map[int]string{}
	procs, _ := filepath.Glob("/proc/[0-9]*/cmdline")
	for _, p := range procs {
		raw, err := os.ReadFile(p)
		if err != nil || !bytes.Contains(raw, []byte("qemu")) {
			continue
		}
		i := bytes.Index(raw, []byte(dir))
		if i < 0 {
			continue
		}
		id, _, _ := strings.Cut(string(raw[i+len(dir):]), "/")
		var st struct {
			ID string `json:"id"`
		}
		if b, err := os.ReadFile(filepath.Join(dir, id, "state.json")); err == nil && json.Unmarshal(b, &st) == nil && st.ID != "" {
			id = st.ID
		}
		if pid, err := strconv.Atoi(filepath.Base(filepath.Dir(p))); err == nil {
			out[pid] = id
		}
	}
	return out
}

// qemuPid is the pid of the QEMU running sandbox id (0 when none).
func (n *node) qemuPid(id string) int {
	for pid, sid := range n.qemuPids() {
		if sid == id {
			return pid
		}
	}
	return 0
}

// microvmLeftovers is what a stopped microvm node left besides leftovers' findings: QEMU
// processes, RAM files, memory images and capture layers.
func microvmLeftovers(t *testing.T, n *node) []string {
	t.Helper()
	out := leftovers(t, n, nil)
	for pid, id := range n.qemuPids() {
		out = append(out, fmt.Sprintf("QEMU pid %d (sandbox %s)", pid, id))
	}
	for _, dir := range []string{n.ramDir(), filepath.Join(n.dataDir, "microvm", "sandboxes"),
		filepath.Join(n.dataDir, "microvm", "captures"), filepath.Join(n.dataDir, "microvm", "images")} {
		ents, _ := os.ReadDir(dir)
		for _, e := range ents {
			out = append(out, filepath.Join(dir, e.Name()))
		}
	}
	return out
}

// counterScript starts a counter that lives in a background process's memory and
// advances once per poke (a line written to the FIFO /tmp/poke, held open read-write so a
// poke never blocks): a restarted process would start again at 0. It prints the pid.
const counterScript = `rm -f /tmp/poke /tmp/count; mkfifo /tmp/poke
setsid bash -c 'exec 3<>/tmp/poke; echo $$ > /tmp/counter.pid; i=0; echo $i > /tmp/count; while read x <&3; do i=$((i+1)); echo $i > /tmp/count.new; mv /tmp/count.new /tmp/count; done' >/dev/null 2>&1 </dev/null &
n=0; while [ ! -s /tmp/count ] && [ $n -lt 300 ]; do sleep 0.2; n=$((n+1)); done; cat /tmp/counter.pid`

// poke advances sb's counter k times and returns "pid value" once it has.
func poke(ctx context.Context, t *testing.T, c *bench.Client, sb bench.Sandbox, k int) string {
	t.Helper()
	return run(ctx, t, c, sb, fmt.Sprintf(`v=$(cat /tmp/count); for i in $(seq %d); do echo >> /tmp/poke; done
want=$((v+%d)); n=0; while [ "$(cat /tmp/count)" != "$want" ] && [ $n -lt 300 ]; do sleep 0.2; n=$((n+1)); done
p=$(cat /tmp/counter.pid); kill -0 $p && echo $p $(cat /tmp/count)`, k, k))
}

// TestMicroVMNode runs a microvm node as a node runs: volumes refused (400), a secret in
// envVars, create from a template, commands and files, snapshot + fork (every child continues a process with its memory), pause and
// resume; then kills the node with SIGKILL in the middle of a burst of snapshots and forks
// (twice) and checks each restart adopts the running VMs (same QEMU, same guest process
// and memory), and that in the end nothing is left: QEMU processes, netns (and the taps
// in them), RAM files, memory images, capture layers, mounts, the data plane.
func TestMicroVMNode(t *testing.T) {
	n := microvmNode(t)
	n.start()
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Minute)
	defer cancel()
	c := n.client()

	// Volumes: refused with a 400 naming the backend, nothing started (a VM has no
	// channel for the node's volume directories; docs/operations.md says why).
	if _, err := n.api(ctx, http.MethodPost, "/volumes", `{"name":"vmvol"}`, http.StatusCreated); err != nil {
		t.Fatal(err)
	}
	out, err := n.api(ctx, http.MethodPost, "/v2/sandboxes", `{"templateID":"base-minimal","volumeMounts":[{"name":"vmvol","path":"/mnt/v"}]}`, http.StatusBadRequest)
	if err != nil || !strings.Contains(string(out), "microvm") {
		t.Errorf("create with a volume on microvm: %s, %v", out, err)
	}
	if left := states(ctx, t, c); len(left) != 0 {
		t.Errorf("sandboxes after the refused create: %v", left)
	}
	// Secrets: a placeholder in envVars reaches the guest's environment.
	const secret = "it-mv-secret-8f14e45fceea167a"
	if _, err := n.api(ctx, http.MethodPost, "/secrets", `{"name":"tok","value":"`+secret+`"}`, http.StatusCreated); err != nil {
		t.Fatal(err)
	}

	t0 := time.Now()
	out, err = n.api(ctx, http.MethodPost, "/v2/sandboxes", `{"templateID":"base-minimal","timeout":900,"secure":true,"envVars":{"TOK":"${e2b.secrets.tok}"}}`, http.StatusCreated)
	if err != nil {
		t.Fatalf("create: %v", err)
	}
	var a bench.Sandbox
	if err := json.Unmarshal(out, &a); err != nil {
		t.Fatal(err)
	}
	t.Logf("first create (boots the template) in %v", time.Since(t0).Round(time.Millisecond))
	if host, _ := os.ReadFile("/proc/sys/kernel/osrelease"); run(ctx, t, c, a, "uname -r") == strings.TrimSpace(string(host)) {
		t.Error("the sandbox runs the host's kernel")
	}
	if got := run(ctx, t, c, a, `echo "$TOK"`); got != secret {
		t.Errorf("TOK in the VM = %q", got)
	}
	putFile(ctx, t, n, a, "user", "/home/user/note", "kept")
	if got := getFile(ctx, t, n, a, "user", "/home/user/note"); got != "kept" {
		t.Fatalf("read back %q", got)
	}
	pid := run(ctx, t, c, a, counterScript)
	if got, want := poke(ctx, t, c, a, 3), pid+" 3"; got != want {
		t.Fatalf("counter %q, want %q", got, want)
	}

	// Snapshot: a sandbox created from it continues the process from the same value.
	snap, err := c.Snapshot(ctx, a.ID)
	if err != nil {
		t.Fatal(err)
	}
	fromSnap, err := c.Create(ctx, bench.CreateRequest{TemplateID: snap, Timeout: 900, Secure: true})
	if err != nil {
		t.Fatalf("create from snapshot: %v", err)
	}
	if got, want := poke(ctx, t, c, fromSnap, 1), pid+" 4"; got != want {
		t.Errorf("sandbox from the snapshot: counter %q, want %q", got, want)
	}
	// Fork 2: each child continues from the same value and writes on its own.
	kids, err := c.Fork(ctx, a.ID, 2, 900)
	if err != nil {
		t.Fatal(err)
	}
	var forks []bench.Sandbox
	for i, k := range kids {
		if k.Sandbox == nil {
			t.Fatalf("fork %d: %+v", i, k.Error)
		}
		forks = append(forks, *k.Sandbox)
	}
	for i, f := range forks {
		if got, want := poke(ctx, t, c, f, 1+i), fmt.Sprintf("%s %d", pid, 4+i); got != want {
			t.Errorf("fork %d: counter %q, want %q", i, got, want)
		}
		run(ctx, t, c, f, fmt.Sprintf("echo fork-%d > /home/user/own", i))
		// Named after itself, not after a (the node's /init; envd's -set-hostname).
		if got := strings.TrimSpace(run(ctx, t, c, f, "hostname")); got != f.ID {
			t.Errorf("fork %d (%s): host name %q", i, f.ID, got)
		}
	}
	if got := run(ctx, t, c, forks[0], `cat /home/user/own; cat /home/user/note; echo; echo "$TOK"`); got != "fork-0\nkept\n"+secret {
		t.Errorf("fork 0 reads %q", got)
	}
	// Pause with memory and resume: same process, same memory.
	if err := c.PauseKeepingMemory(ctx, a.ID); err != nil {
		t.Fatal(err)
	}
	if st := states(ctx, t, c)[a.ID]; st != "paused" {
		t.Fatalf("after pause: %q", st)
	}
	if a, err = c.Connect(ctx, a.ID, 900); err != nil {
		t.Fatalf("resume: %v", err)
	}
	if got, want := poke(ctx, t, c, a, 1), pid+" 4"; got != want {
		t.Errorf("after resume: counter %q, want %q", got, want)
	}
	for _, id := range []string{fromSnap.ID, forks[1].ID} {
		if err := c.Kill(ctx, id); err != nil {
			t.Fatal(err)
		}
	}
	if err := c.DeleteTemplate(ctx, snap); err != nil {
		t.Fatal(err)
	}

	// The survivors (a and its first fork) run on through kills of the node in the
	// middle of snapshots of a and forks of b.
	b, err := c.Create(ctx, bench.CreateRequest{TemplateID: "base-minimal", Timeout: 900, Secure: true})
	if err != nil {
		t.Fatal(err)
	}
	type survivorVM struct {
		sb      bench.Sandbox
		qemu    int
		counter string
		value   int
	}
	ss := []*survivorVM{{sb: a, counter: pid, value: 4}, {sb: forks[0], counter: pid, value: 4}}
	for _, s := range ss {
		if s.qemu = n.qemuPid(s.sb.ID); s.qemu == 0 {
			t.Fatalf("no QEMU runs %s: %v", s.sb.ID, n.qemuPids())
		}
	}
	rng := rand.New(rand.NewPCG(uint64(time.Now().UnixNano()), 2))
	for round := range 2 {
		stop := make(chan struct{})
		var wg sync.WaitGroup
		for w, act := range []func(context.Context) error{
			func(ctx context.Context) error { return snapshotOf(ctx, n, a.ID) },
			func(ctx context.Context) error {
				kids, err := c.Fork(ctx, b.ID, 2, 900)
				for _, k := range kids {
					if k.Sandbox != nil {
						_ = c.Kill(ctx, k.Sandbox.ID)
					}
				}
				return err
			},
		} {
			wg.Add(1)
			go func() {
				defer wg.Done()
				ctx, cancel := context.WithTimeout(ctx, 3*time.Minute)
				defer cancel()
				for {
					select {
					case <-stop:
						return
					default:
					}
					if err := act(ctx); err != nil {
						t.Logf("round %d worker %d: %v (expected once the node dies)", round, w, err)
						return
					}
				}
			}()
		}
		time.Sleep(time.Duration(500+rng.IntN(3000)) * time.Millisecond)
		n.kill9()
		close(stop)
		start := time.Now()
		n.restartWith()
		t.Logf("round %d: restart → API answering in %v", round, time.Since(start).Round(time.Millisecond))
		wg.Wait()

		got := states(ctx, t, c)
		for _, s := range ss {
			if got[s.sb.ID] != "running" {
				t.Fatalf("round %d: %s is %q after the restart", round, s.sb.ID, got[s.sb.ID])
			}
			if q := n.qemuPid(s.sb.ID); q != s.qemu {
				t.Errorf("round %d: %s runs on QEMU %d, was %d", round, s.sb.ID, q, s.qemu)
			}
			s.value++
			if got, want := poke(ctx, t, c, s.sb, 1), fmt.Sprintf("%s %d", s.counter, s.value); got != want {
				t.Errorf("round %d: %s counter %q, want %q", round, s.sb.ID, got, want)
			}
		}
		// What the interrupted work left goes (b stays, for the next round's forks).
		for id := range got {
			if id != a.ID && id != forks[0].ID && id != b.ID {
				if err := c.Kill(ctx, id); err != nil {
					t.Error(err)
				}
			}
		}
		if t.Failed() {
			t.FailNow()
		}
		live := states(ctx, t, c)
		for qpid, id := range n.qemuPids() {
			if _, ok := live[id]; !ok {
				t.Errorf("round %d: QEMU %d runs for %s, which the node does not list", round, qpid, id)
			}
		}
	}

	for _, id := range n.snapshots(ctx, t) {
		if err := c.DeleteTemplate(ctx, id); err != nil {
			t.Error(err)
		}
	}
	killAll(ctx, t, c)
	n.stop()
	// The sealed disk layers of discarded captures go when no running disk has them as a
	// lower; the backend learns that at its start (ReconcileCaptures), so one more start
	// with nothing running reclaims the layers that the killed sandboxes ran on.
	n.start()
	n.stop()
	if pid := n.dataPlanePid(t); pid != 0 {
		t.Errorf("the idle data plane (pid %d) still runs after the node stopped", pid)
		n.stopDataPlane(t)
	}
	if left := microvmLeftovers(t, n); len(left) > 0 {
		t.Fatalf("left behind:\n  %s", strings.Join(left, "\n  "))
	}
	// An upload the kills interrupted leaves its temporary blob in the repository's tmp/,
	// which Open removes once older than an hour (the repository may be shared, and
	// another node's upload in flight looks the same); memory images (the guest's RAM)
	// take long enough to upload that a kill often lands in one.
	requireNoStateLeftovers(t, n, "repository/tmp")
}

// TestMicroVMEgressProxy runs the egress proxy flow (domains in allowOut, request
// transforms, SOCKS5, DNS rebinding refused) against a VM: its tap sits in the slot's
// namespace and the guest holds the slot's address, so the node's redirect and address
// rules apply to it unchanged.
func TestMicroVMEgressProxy(t *testing.T) {
	egressProxyFlow(t, "aitegr-mv", "aitegrm0", func(env ...string) *node { return microvmNode(t, env...) })
}
