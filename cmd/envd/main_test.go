package main

import (
	"bufio"
	"bytes"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
)

// The test binary doubles as envd: ENVD_TEST_MAIN=1 runs main() with the remaining arguments.
func TestMain(m *testing.M) {
	if os.Getenv("ENVD_TEST_MAIN") == "1" {
		os.Args = append([]string{"envd"}, os.Args[1:]...)
		main()
		os.Exit(0)
	}
	os.Exit(m.Run())
}

func freePort(t *testing.T) int {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port
}

// startEnvd runs envd (optionally as PID 1 of a new PID namespace) and waits for /health.
func startEnvd(t *testing.T, pid1 bool, extra ...string) (base string, cmd *exec.Cmd, envdPid func() int) {
	t.Helper()
	port := freePort(t)
	args := append([]string{"--port", strconv.Itoa(port), "--host", "127.0.0.1", "--shutdown-grace", "3s"}, extra...)
	if pid1 {
		if os.Geteuid() != 0 {
			t.Skip("needs root for a PID namespace")
		}
		u, err := exec.LookPath("unshare")
		if err != nil {
			t.Skip("unshare not installed")
		}
		cmd = exec.Command(u, append([]string{"--pid", "--fork", "--mount-proc", "--kill-child", os.Args[0]}, args...)...)
	} else {
		cmd = exec.Command(os.Args[0], args...)
	}
	cmd.Env = append(os.Environ(), "ENVD_TEST_MAIN=1", "GOMAXPROCS=1") // as the node runs it
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
		if t.Failed() {
			t.Logf("envd stderr:\n%s", stderr.String())
		}
	})
	base = fmt.Sprintf("http://127.0.0.1:%d", port)
	for i := 0; ; i++ {
		resp, err := http.Get(base + "/health")
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == 204 {
				break
			}
		}
		if i > 200 {
			t.Fatalf("envd not healthy: %v\n%s", err, stderr.String())
		}
		time.Sleep(25 * time.Millisecond)
	}
	envdPid = func() int {
		if !pid1 {
			return cmd.Process.Pid
		}
		b, _ := os.ReadFile(fmt.Sprintf("/proc/%d/task/%d/children", cmd.Process.Pid, cmd.Process.Pid))
		p, _ := strconv.Atoi(strings.Fields(string(b) + " 0")[0])
		return p
	}
	return base, cmd, envdPid
}

// startStream posts a Start request (Connect, JSON) and returns the response body.
func startStream(t *testing.T, base, script string) io.ReadCloser {
	t.Helper()
	body, _ := json.Marshal(map[string]any{"process": map[string]any{"cmd": "/bin/sh", "args": []string{"-c", script}}, "stdin": false})
	env := append([]byte{0, 0, 0, 0, 0}, body...)
	binary.BigEndian.PutUint32(env[1:5], uint32(len(body)))
	req, _ := http.NewRequest("POST", base+"/process.Process/Start", bytes.NewReader(env))
	req.Header.Set("Content-Type", "application/connect+json")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	return resp.Body
}

// events reads envelopes until end-of-stream, returning decoded messages as raw JSON strings.
func events(r io.Reader) (msgs []string, eos string) {
	br := bufio.NewReader(r)
	for {
		var hdr [5]byte
		if _, err := io.ReadFull(br, hdr[:]); err != nil {
			return msgs, ""
		}
		b := make([]byte, binary.BigEndian.Uint32(hdr[1:]))
		if _, err := io.ReadFull(br, b); err != nil {
			return msgs, ""
		}
		if hdr[0]&2 != 0 {
			return msgs, string(b)
		}
		msgs = append(msgs, string(b))
	}
}

func runScript(t *testing.T, base, script string) string {
	t.Helper()
	body := startStream(t, base, script)
	defer body.Close()
	msgs, eos := events(body)
	if eos != "{}" {
		t.Fatalf("end of stream %q after %v", eos, msgs)
	}
	var out []byte
	for _, m := range msgs {
		var ev struct {
			Event struct {
				Data struct {
					Stdout []byte `json:"stdout"`
				} `json:"data"`
			} `json:"event"`
		}
		_ = json.Unmarshal([]byte(m), &ev)
		out = append(out, ev.Event.Data.Stdout...)
	}
	return string(out)
}

// As PID 1, envd reaps orphans (no zombies pile up) and survives its children's deaths.
func TestPID1ReapsOrphans(t *testing.T) {
	base, _, _ := startEnvd(t, true)
	if got := runScript(t, base, "echo $$ $PPID"); !strings.HasSuffix(strings.TrimSpace(got), " 1") {
		t.Fatalf("parent is not PID 1: %q", got)
	}
	for i := 0; i < 20; i++ {
		runScript(t, base, "sleep 0.05 & sleep 0.01 & exit 0")
	}
	time.Sleep(300 * time.Millisecond)
	// Count zombies in the namespace (state is the field after the ")" of the command name).
	out := runScript(t, base, `for f in /proc/[0-9]*/stat; do s=$(cat $f 2>/dev/null) || continue; s=${s##*) }; echo "${s%% *}"; done | grep -c Z || true`)
	if strings.TrimSpace(out) != "0" {
		t.Fatalf("zombies: %q", out)
	}
}

// SIGTERM is forwarded to running processes, which get the grace period; then envd exits 0.
func TestSignalForwardingAndShutdown(t *testing.T) {
	for _, pid1 := range []bool{false, true} {
		t.Run(fmt.Sprintf("pid1=%v", pid1), func(t *testing.T) {
			base, cmd, envdPid := startEnvd(t, pid1)
			body := startStream(t, base, `trap 'echo got-term; exit 0' TERM; echo ready; while :; do sleep 0.05; done`)
			defer body.Close()
			br := bufio.NewReader(body)
			// Wait for "ready" before signalling.
			var seen []string
			for !strings.Contains(strings.Join(seen, ""), "cmVhZHkK") { // base64("ready\n")
				var hdr [5]byte
				if _, err := io.ReadFull(br, hdr[:]); err != nil {
					t.Fatal(err)
				}
				b := make([]byte, binary.BigEndian.Uint32(hdr[1:]))
				_, _ = io.ReadFull(br, b)
				seen = append(seen, string(b))
			}
			pid := envdPid()
			if pid <= 0 {
				t.Fatal("cannot find envd's pid")
			}
			if err := syscall.Kill(pid, syscall.SIGTERM); err != nil {
				t.Fatal(err)
			}
			msgs, eos := events(br)
			all := strings.Join(msgs, "")
			if !strings.Contains(all, "Z290LXRlcm0K") || !strings.Contains(all, `"end"`) || eos != "{}" { // base64("got-term\n")
				t.Fatalf("process did not get SIGTERM: %v %q", msgs, eos)
			}
			done := make(chan error, 1)
			go func() { done <- cmd.Wait() }()
			select {
			case err := <-done:
				if err != nil {
					t.Fatalf("envd exit: %v", err)
				}
			case <-time.After(10 * time.Second):
				t.Fatal("envd did not exit")
			}
		})
	}
}

// Commands get SIGPIPE's default action, not an ignored SIGPIPE inherited from envd: the
// writer of a pipeline whose reader quit dies of it (status 141) rather than failing with
// EPIPE and printing "Broken pipe", as everywhere else. envd ignores nothing more than it
// was started with (this test's own ignored signals: a CI harness may ignore some).
func TestCommandsGetDefaultSignals(t *testing.T) {
	status, err := os.ReadFile("/proc/self/status")
	if err != nil {
		t.Fatal(err)
	}
	var ign string
	for _, l := range strings.Split(string(status), "\n") {
		if strings.HasPrefix(l, "SigIgn:") {
			ign = l
		}
	}
	if ign == "" || strings.HasSuffix(ign, "1000") {
		t.Skipf("this test runs with SIGPIPE ignored (%q): it cannot tell what envd adds", ign)
	}
	for _, forward := range []bool{true, false} {
		t.Run(fmt.Sprintf("forward-signals=%v", forward), func(t *testing.T) {
			base, _, _ := startEnvd(t, false, fmt.Sprintf("--forward-signals=%v", forward))
			f := t.TempDir() + "/status"
			got := runScript(t, base, fmt.Sprintf(`grep SigIgn /proc/self/status; { yes; echo "yes:$?" >%s; } | head -1 >/dev/null; cat %s`, f, f))
			if !strings.Contains(got, ign+"\n") || !strings.Contains(got, "yes:141") {
				t.Fatalf("a command inherits ignored signals:\n%s", got)
			}
		})
	}
}

// Without signal forwarding (the node's containers) an idle envd keeps two threads fewer than
// with it: Go's signal delivery holds two threads blocked (and can make the runtime start a
// third), and the reaper takes no signal. A node holds thousands of idle envds, and
// pivot_root walks every thread on the host.
func TestIdleThreads(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root for a PID namespace")
	}
	threads := func(extra ...string) int {
		base, _, pid := startEnvd(t, true, extra...)
		for i := 0; i < 3; i++ {
			runScript(t, base, "sleep 0.05 & exit 0") // a child and an orphan to reap
		}
		time.Sleep(200 * time.Millisecond)
		tasks, err := os.ReadDir(fmt.Sprintf("/proc/%d/task", pid()))
		if err != nil {
			t.Fatal(err)
		}
		return len(tasks)
	}
	on, off := threads(), threads("--forward-signals=false")
	t.Logf("idle envd threads: %d forwarding signals, %d not", on, off)
	if off > on-2 {
		t.Fatalf("idle envd without signal forwarding has %d threads, forwarding %d: want two fewer", off, on)
	}
}
