package envd_test

import (
	"bytes"
	"context"
	"errors"
	"io"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"connectrpc.com/connect"
	"golang.org/x/sys/unix"

	pb "github.com/aenv-dev/aenv/internal/envd/gen/process"
	"github.com/aenv-dev/aenv/internal/envd/gen/process/processconnect"
)

func ptr[T any](v T) *T { return &v }

func TestStartEcho(t *testing.T) {
	e := newEnv(t, envOpts{})
	r := e.run(t.Context(), "echo hi; echo err >&2")
	if r.err != nil {
		t.Fatal(r.err)
	}
	if r.events[0].GetStart() == nil || r.pid == 0 {
		t.Fatalf("first event is not start: %v", r.events[0])
	}
	if string(r.stdout) != "hi\n" || string(r.stderr) != "err\n" {
		t.Fatalf("stdout %q stderr %q", r.stdout, r.stderr)
	}
	if r.end == nil || r.end.ExitCode != 0 || !r.end.Exited || r.end.Status != "exit status 0" || r.end.Error != nil {
		t.Fatalf("end = %v", r.end)
	}
	if last := r.events[len(r.events)-1]; last.GetEnd() == nil {
		t.Fatalf("last event is not end: %v", last)
	}
}

func TestStartExitCodeAndSignal(t *testing.T) {
	e := newEnv(t, envOpts{})
	r := e.run(t.Context(), "exit 3")
	if r.end == nil || r.end.ExitCode != 3 || !r.end.Exited || r.end.GetError() != "exit status 3" {
		t.Fatalf("end = %v (err %v)", r.end, r.err)
	}
	r = e.run(t.Context(), "kill -9 $$")
	if r.end == nil || r.end.ExitCode != -1 || r.end.Exited || r.end.Status != "signal: killed" || r.end.GetError() != "signal: killed" {
		t.Fatalf("end = %v (err %v)", r.end, r.err)
	}
}

// The SDK speaks Connect with the JSON codec; Go clients may use gRPC over h2c.
func TestStartCodecsAndProtocols(t *testing.T) {
	e := newEnv(t, envOpts{})
	clients := map[string]processconnect.ProcessClient{
		"connect+json": processconnect.NewProcessClient(e.httpClient(), e.url, connect.WithProtoJSON()),
		"grpc":         processconnect.NewProcessClient(e.h2cClient(), e.url, connect.WithGRPC()),
		"grpc-web":     processconnect.NewProcessClient(e.httpClient(), e.url, connect.WithGRPCWeb()),
	}
	for name, c := range clients {
		t.Run(name, func(t *testing.T) {
			s, err := c.Start(t.Context(), connect.NewRequest(&pb.StartRequest{Process: &pb.ProcessConfig{Cmd: "echo", Args: []string{"x"}}}))
			if err != nil {
				t.Fatal(err)
			}
			r := collect[*pb.StartResponse](s)
			if r.err != nil || string(r.stdout) != "x\n" || r.end == nil {
				t.Fatalf("%s: %+v", name, r)
			}
		})
	}
}

func TestStartUserEnvCwd(t *testing.T) {
	e := newEnv(t, envOpts{})
	e.srv.Process.SignalAll(0)
	r := e.run(t.Context(), `echo "$USER|$HOME|$LOGNAME|$E2B_SANDBOX|$A|$(pwd)|$(id -u)"`, func(r *connect.Request[pb.StartRequest]) {
		r.Msg.Process.Envs = map[string]string{"A": "1"}
	})
	want := e.user + "|" + e.home + "|" + e.user + "|true|1|" + e.home + "|"
	if !strings.HasPrefix(string(r.stdout), want) {
		t.Fatalf("got %q want prefix %q (err %v)", r.stdout, want, r.err)
	}
	if isRoot() && strings.TrimSpace(strings.Split(string(r.stdout), "|")[6]) != strconv.Itoa(testUID) {
		t.Fatalf("not running as the test user: %q", r.stdout)
	}
	// cwd: relative to home, ~, absolute.
	for cwd, want := range map[string]string{"": e.home, "~": e.home, "/tmp": "/tmp", ".": e.home} {
		r := e.run(t.Context(), "pwd", func(r *connect.Request[pb.StartRequest]) { r.Msg.Process.Cwd = ptr(cwd) })
		if strings.TrimSpace(string(r.stdout)) != want {
			t.Errorf("cwd %q: pwd = %q, want %q (%v)", cwd, r.stdout, want, r.err)
		}
	}
	r = e.run(t.Context(), "pwd", func(r *connect.Request[pb.StartRequest]) { r.Msg.Process.Cwd = ptr("/no/such/dir") })
	if codeOf(r.err) != connect.CodeInvalidArgument || !strings.Contains(r.err.Error(), "does not exist") {
		t.Fatalf("missing cwd: %v", r.err)
	}
}

func TestStartAsRootViaBasicAuth(t *testing.T) {
	if !isRoot() {
		t.Skip("needs root to switch users")
	}
	e := newEnv(t, envOpts{})
	r := e.run(t.Context(), "id -u; id -G", func(r *connect.Request[pb.StartRequest]) {
		r.Header().Set("Authorization", "Basic cm9vdDo=") // root:
	})
	if !strings.HasPrefix(string(r.stdout), "0\n") {
		t.Fatalf("root: %q %v", r.stdout, r.err)
	}
	r = e.run(t.Context(), "id -G")
	if !strings.Contains(string(r.stdout), "4343") {
		t.Fatalf("supplementary group missing: %q", r.stdout)
	}
	r = e.run(t.Context(), "true", func(r *connect.Request[pb.StartRequest]) {
		r.Header().Set("Authorization", "Basic bm9ib2R5eDo=") // nobodyx:
	})
	if codeOf(r.err) != connect.CodeUnauthenticated || !strings.Contains(r.err.Error(), "invalid username: 'nobodyx'") {
		t.Fatalf("unknown user: %v", r.err)
	}
}

func TestStartBadRequests(t *testing.T) {
	e := newEnv(t, envOpts{})
	for name, req := range map[string]*pb.StartRequest{
		"no process":     {},
		"empty cmd":      {Process: &pb.ProcessConfig{}},
		"missing binary": {Process: &pb.ProcessConfig{Cmd: "/no/such/binary"}},
		"not in PATH":    {Process: &pb.ProcessConfig{Cmd: "no-such-command-xyz"}},
		"NUL in arg":     {Process: &pb.ProcessConfig{Cmd: "echo", Args: []string{"a\x00b"}}},
		"bad env key":    {Process: &pb.ProcessConfig{Cmd: "echo", Envs: map[string]string{"A=B": "c"}}},
	} {
		s, err := e.proc.Start(t.Context(), connect.NewRequest(req))
		if err == nil {
			r := collect[*pb.StartResponse](s)
			err = r.err
		}
		if codeOf(err) != connect.CodeInvalidArgument {
			t.Errorf("%s: %v", name, err)
		}
	}
}

func TestKeepalive(t *testing.T) {
	e := newEnv(t, envOpts{})
	r := e.run(t.Context(), "sleep 3.5", func(r *connect.Request[pb.StartRequest]) {
		r.Header().Set("Keepalive-Ping-Interval", "1")
	})
	if r.err != nil || r.keepalives < 2 {
		t.Fatalf("keepalives = %d, err %v", r.keepalives, r.err)
	}
}

func TestTimeoutKillsProcess(t *testing.T) {
	e := newEnv(t, envOpts{})
	ctx, cancel := context.WithTimeout(t.Context(), 400*time.Millisecond)
	defer cancel()
	start := time.Now()
	r := e.run(ctx, "sleep 30")
	if codeOf(r.err) != connect.CodeDeadlineExceeded {
		t.Fatalf("err = %v", r.err)
	}
	waitGone(t, r.pid, 3*time.Second)
	if time.Since(start) > 5*time.Second {
		t.Fatal("took too long")
	}
}

func waitGone(t *testing.T, pid uint32, d time.Duration) {
	t.Helper()
	deadline := time.Now().Add(d)
	for time.Now().Before(deadline) {
		if err := unix.Kill(int(pid), 0); errors.Is(err, syscall.ESRCH) {
			return
		}
		time.Sleep(10 * time.Millisecond)
	}
	t.Fatalf("process %d still exists", pid)
}

// A client that goes away leaves the process running; Connect by pid or tag re-attaches.
func TestBackgroundConnectByPidAndTag(t *testing.T) {
	e := newEnv(t, envOpts{})
	ctx, cancel := context.WithCancel(t.Context())
	s, err := e.proc.Start(ctx, connect.NewRequest(&pb.StartRequest{
		Process: &pb.ProcessConfig{Cmd: "/bin/bash", Args: []string{"-c", "read x; echo got $x; sleep 0.2; echo bye"}},
		Tag:     ptr("job-1"),
	}))
	if err != nil {
		t.Fatal(err)
	}
	if !s.Receive() || s.Msg().GetEvent().GetStart() == nil {
		t.Fatal("no start event")
	}
	pid := s.Msg().GetEvent().GetStart().GetPid()
	cancel()
	s.Close()

	list, err := e.proc.List(t.Context(), connect.NewRequest(&pb.ListRequest{}))
	if err != nil {
		t.Fatal(err)
	}
	found := false
	for _, p := range list.Msg.Processes {
		if p.Pid == pid && p.GetTag() == "job-1" && p.Config.GetCmd() == "/bin/bash" {
			found = true
		}
	}
	if !found {
		t.Fatalf("process %d not listed: %v", pid, list.Msg)
	}

	c, err := e.proc.Connect(t.Context(), connect.NewRequest(&pb.ConnectRequest{Process: &pb.ProcessSelector{Selector: &pb.ProcessSelector_Tag{Tag: "job-1"}}}))
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan result)
	go func() { done <- collect[*pb.ConnectResponse](c) }()
	time.Sleep(100 * time.Millisecond) // let Connect attach before the output exists
	if _, err := e.proc.SendInput(t.Context(), connect.NewRequest(&pb.SendInputRequest{
		Process: &pb.ProcessSelector{Selector: &pb.ProcessSelector_Pid{Pid: pid}},
		Input:   &pb.ProcessInput{Input: &pb.ProcessInput_Stdin{Stdin: []byte("42\n")}},
	})); err != nil {
		t.Fatal(err)
	}
	r := <-done
	if r.err != nil || r.pid != pid || string(r.stdout) != "got 42\nbye\n" || r.end == nil {
		t.Fatalf("connect: %+v", r)
	}

	// Just finished: Connect replays start + end.
	c2, err := e.proc.Connect(t.Context(), connect.NewRequest(&pb.ConnectRequest{Process: &pb.ProcessSelector{Selector: &pb.ProcessSelector_Pid{Pid: pid}}}))
	if err != nil {
		t.Fatal(err)
	}
	r = collect[*pb.ConnectResponse](c2)
	if r.err != nil || r.pid != pid || r.end == nil || r.end.ExitCode != 0 {
		t.Fatalf("replay: %+v", r)
	}
	// Unknown pid / tag.
	c3, _ := e.proc.Connect(t.Context(), connect.NewRequest(&pb.ConnectRequest{Process: &pb.ProcessSelector{Selector: &pb.ProcessSelector_Tag{Tag: "nope"}}}))
	if r := collect[*pb.ConnectResponse](c3); codeOf(r.err) != connect.CodeNotFound {
		t.Fatalf("unknown tag: %v", r.err)
	}
	c4, _ := e.proc.Connect(t.Context(), connect.NewRequest(&pb.ConnectRequest{}))
	if r := collect[*pb.ConnectResponse](c4); codeOf(r.err) != connect.CodeInvalidArgument {
		t.Fatalf("no selector: %v", r.err)
	}
}

func TestSendSignal(t *testing.T) {
	e := newEnv(t, envOpts{})
	s, err := e.proc.Start(t.Context(), connect.NewRequest(&pb.StartRequest{Process: &pb.ProcessConfig{Cmd: "sleep", Args: []string{"100"}}}))
	if err != nil {
		t.Fatal(err)
	}
	s.Receive()
	pid := s.Msg().GetEvent().GetStart().GetPid()
	sel := &pb.ProcessSelector{Selector: &pb.ProcessSelector_Pid{Pid: pid}}

	_, err = e.proc.SendSignal(t.Context(), connect.NewRequest(&pb.SendSignalRequest{Process: sel, Signal: pb.Signal_SIGNAL_UNSPECIFIED}))
	if codeOf(err) != connect.CodeInvalidArgument {
		t.Fatalf("unspecified signal: %v", err)
	}
	_, err = e.proc.SendSignal(t.Context(), connect.NewRequest(&pb.SendSignalRequest{Process: sel, Signal: pb.Signal(77)}))
	if codeOf(err) != connect.CodeInvalidArgument {
		t.Fatalf("unknown enum value: %v", err)
	}
	if _, err := e.proc.SendSignal(t.Context(), connect.NewRequest(&pb.SendSignalRequest{Process: sel, Signal: pb.Signal_SIGNAL_SIGTERM})); err != nil {
		t.Fatal(err)
	}
	r := collect[*pb.StartResponse](s)
	if r.end == nil || r.end.ExitCode != -1 || r.end.Status != "signal: terminated" {
		t.Fatalf("end = %v", r.end)
	}
	_, err = e.proc.SendSignal(t.Context(), connect.NewRequest(&pb.SendSignalRequest{Process: sel, Signal: pb.Signal_SIGNAL_SIGKILL}))
	if codeOf(err) != connect.CodeNotFound {
		t.Fatalf("signal to finished process: %v", err)
	}
	_, err = e.proc.SendSignal(t.Context(), connect.NewRequest(&pb.SendSignalRequest{
		Process: &pb.ProcessSelector{Selector: &pb.ProcessSelector_Pid{Pid: 4000000}}, Signal: pb.Signal_SIGNAL_SIGKILL}))
	if codeOf(err) != connect.CodeNotFound {
		t.Fatalf("unknown pid: %v", err)
	}
}

// The SDK depends on a JSON not_found body (not a plain 404) to return false from kill().
func TestSendSignalNotFoundIsJSON(t *testing.T) {
	e := newEnv(t, envOpts{})
	resp, err := http.Post(e.url+"/process.Process/SendSignal", "application/json",
		strings.NewReader(`{"process":{"pid":9999999},"signal":"SIGNAL_SIGKILL"}`))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != 404 || !strings.HasPrefix(resp.Header.Get("Content-Type"), "application/json") || !bytes.Contains(b, []byte(`"code":"not_found"`)) {
		t.Fatalf("%d %s %s", resp.StatusCode, resp.Header.Get("Content-Type"), b)
	}
}

func TestStdinCloseStdinAndStreamInput(t *testing.T) {
	e := newEnv(t, envOpts{})
	s, err := e.proc.Start(t.Context(), connect.NewRequest(&pb.StartRequest{Process: &pb.ProcessConfig{Cmd: "cat"}, Stdin: ptr(true)}))
	if err != nil {
		t.Fatal(err)
	}
	s.Receive()
	pid := s.Msg().GetEvent().GetStart().GetPid()
	sel := &pb.ProcessSelector{Selector: &pb.ProcessSelector_Pid{Pid: pid}}
	if _, err := e.proc.SendInput(t.Context(), connect.NewRequest(&pb.SendInputRequest{Process: sel,
		Input: &pb.ProcessInput{Input: &pb.ProcessInput_Stdin{Stdin: []byte("one ")}}})); err != nil {
		t.Fatal(err)
	}
	si := e.proc.StreamInput(t.Context())
	_ = si.Send(&pb.StreamInputRequest{Event: &pb.StreamInputRequest_Start{Start: &pb.StreamInputRequest_StartEvent{Process: sel}}})
	_ = si.Send(&pb.StreamInputRequest{Event: &pb.StreamInputRequest_Keepalive{Keepalive: &pb.StreamInputRequest_KeepAlive{}}})
	_ = si.Send(&pb.StreamInputRequest{Event: &pb.StreamInputRequest_Data{Data: &pb.StreamInputRequest_DataEvent{
		Input: &pb.ProcessInput{Input: &pb.ProcessInput_Stdin{Stdin: []byte("two\n")}}}}})
	if _, err := si.CloseAndReceive(); err != nil {
		t.Fatal(err)
	}
	_, err = e.proc.SendInput(t.Context(), connect.NewRequest(&pb.SendInputRequest{Process: sel,
		Input: &pb.ProcessInput{Input: &pb.ProcessInput_Pty{Pty: []byte("x")}}}))
	if codeOf(err) != connect.CodeFailedPrecondition {
		t.Fatalf("pty input to a pipe process: %v", err)
	}
	if _, err := e.proc.CloseStdin(t.Context(), connect.NewRequest(&pb.CloseStdinRequest{Process: sel})); err != nil {
		t.Fatal(err)
	}
	r := collect[*pb.StartResponse](s)
	if string(r.stdout) != "one two\n" || r.end == nil || r.end.ExitCode != 0 {
		t.Fatalf("%+v", r)
	}
	_, err = e.proc.CloseStdin(t.Context(), connect.NewRequest(&pb.CloseStdinRequest{Process: sel}))
	if codeOf(err) != connect.CodeNotFound {
		t.Fatalf("close stdin of a finished process: %v", err)
	}

	// stdin: false → /dev/null, and input is refused.
	s, err = e.proc.Start(t.Context(), connect.NewRequest(&pb.StartRequest{Process: &pb.ProcessConfig{Cmd: "/bin/sh", Args: []string{"-c", "cat; sleep 0.3"}}, Stdin: ptr(false)}))
	if err != nil {
		t.Fatal(err)
	}
	s.Receive()
	sel = &pb.ProcessSelector{Selector: &pb.ProcessSelector_Pid{Pid: s.Msg().GetEvent().GetStart().GetPid()}}
	_, err = e.proc.SendInput(t.Context(), connect.NewRequest(&pb.SendInputRequest{Process: sel,
		Input: &pb.ProcessInput{Input: &pb.ProcessInput_Stdin{Stdin: []byte("x")}}}))
	if codeOf(err) != connect.CodeFailedPrecondition {
		t.Fatalf("input without stdin: %v", err)
	}
	if r := collect[*pb.StartResponse](s); r.end == nil || len(r.stdout) != 0 {
		t.Fatalf("%+v", r)
	}
	// StreamInput must start with a start event.
	si = e.proc.StreamInput(t.Context())
	_ = si.Send(&pb.StreamInputRequest{Event: &pb.StreamInputRequest_Data{Data: &pb.StreamInputRequest_DataEvent{}}})
	if _, err := si.CloseAndReceive(); codeOf(err) != connect.CodeFailedPrecondition {
		t.Fatalf("stream input without start: %v", err)
	}
}

func TestPTY(t *testing.T) {
	e := newEnv(t, envOpts{})
	s, err := e.proc.Start(t.Context(), connect.NewRequest(&pb.StartRequest{
		Process: &pb.ProcessConfig{Cmd: "/bin/bash", Args: []string{"-i", "-l"}, Envs: map[string]string{"TERM": "xterm-256color", "PS1": "$ "}},
		Pty:     &pb.PTY{Size: &pb.PTY_Size{Cols: 80, Rows: 24}},
	}))
	if err != nil {
		t.Fatal(err)
	}
	s.Receive()
	pid := s.Msg().GetEvent().GetStart().GetPid()
	sel := &pb.ProcessSelector{Selector: &pb.ProcessSelector_Pid{Pid: pid}}
	var mu sync.Mutex
	var out []byte
	done := make(chan *pb.ProcessEvent_EndEvent, 1)
	go func() {
		var end *pb.ProcessEvent_EndEvent
		for s.Receive() {
			ev := s.Msg().GetEvent()
			if len(ev.GetData().GetStdout()) > 0 {
				t.Error("stdout data on a PTY process")
			}
			mu.Lock()
			out = append(out, ev.GetData().GetPty()...)
			mu.Unlock()
			if ev.GetEnd() != nil {
				end = ev.GetEnd()
			}
		}
		done <- end
	}()
	waitFor := func(sub string) {
		t.Helper()
		for i := 0; i < 200; i++ {
			mu.Lock()
			ok := strings.Contains(string(out), sub)
			mu.Unlock()
			if ok {
				return
			}
			time.Sleep(25 * time.Millisecond)
		}
		mu.Lock()
		defer mu.Unlock()
		t.Fatalf("%q not in pty output %q", sub, out)
	}
	send := func(in string) {
		t.Helper()
		if _, err := e.proc.SendInput(t.Context(), connect.NewRequest(&pb.SendInputRequest{Process: sel,
			Input: &pb.ProcessInput{Input: &pb.ProcessInput_Pty{Pty: []byte(in)}}})); err != nil {
			t.Fatal(err)
		}
	}
	send("stty size; tty\n")
	waitFor("24 80")
	waitFor("/dev/pts/")
	if _, err := e.proc.Update(t.Context(), connect.NewRequest(&pb.UpdateRequest{Process: sel, Pty: &pb.PTY{Size: &pb.PTY_Size{Cols: 100, Rows: 30}}})); err != nil {
		t.Fatal(err)
	}
	if _, err := e.proc.Update(t.Context(), connect.NewRequest(&pb.UpdateRequest{Process: sel, Pty: &pb.PTY{Size: &pb.PTY_Size{Cols: 0, Rows: 30}}})); codeOf(err) != connect.CodeInvalidArgument {
		t.Fatalf("zero size: %v", err)
	}
	if _, err := e.proc.CloseStdin(t.Context(), connect.NewRequest(&pb.CloseStdinRequest{Process: sel})); codeOf(err) != connect.CodeFailedPrecondition {
		t.Fatalf("close stdin of pty: %v", err)
	}
	send("stty size\n")
	waitFor("30 100")
	send("exit 7\n")
	end := <-done
	if end == nil || end.ExitCode != 7 {
		t.Fatalf("end %v", end)
	}
}

func TestUpdateWithoutPTY(t *testing.T) {
	e := newEnv(t, envOpts{})
	s, err := e.proc.Start(t.Context(), connect.NewRequest(&pb.StartRequest{Process: &pb.ProcessConfig{Cmd: "sleep", Args: []string{"5"}}}))
	if err != nil {
		t.Fatal(err)
	}
	s.Receive()
	sel := &pb.ProcessSelector{Selector: &pb.ProcessSelector_Pid{Pid: s.Msg().GetEvent().GetStart().GetPid()}}
	_, err = e.proc.Update(t.Context(), connect.NewRequest(&pb.UpdateRequest{Process: sel, Pty: &pb.PTY{Size: &pb.PTY_Size{Cols: 1, Rows: 1}}}))
	if codeOf(err) != connect.CodeFailedPrecondition {
		t.Fatalf("resize without pty: %v", err)
	}
	if _, err := e.proc.Update(t.Context(), connect.NewRequest(&pb.UpdateRequest{Process: sel})); err != nil {
		t.Fatalf("empty update: %v", err)
	}
	_, err = e.proc.Update(t.Context(), connect.NewRequest(&pb.UpdateRequest{Process: &pb.ProcessSelector{Selector: &pb.ProcessSelector_Pid{Pid: 4000000}}}))
	if codeOf(err) != connect.CodeNotFound {
		t.Fatalf("update unknown: %v", err)
	}
}

// A background grandchild holding stdout must not keep the stream open after the command exits.
func TestGrandchildDoesNotHoldStream(t *testing.T) {
	e := newEnv(t, envOpts{})
	start := time.Now()
	r := e.run(t.Context(), "sleep 5 & echo started")
	if r.err != nil || r.end == nil || string(r.stdout) != "started\n" {
		t.Fatalf("%+v", r)
	}
	if d := time.Since(start); d > 2*time.Second {
		t.Fatalf("end took %v", d)
	}
}

func TestHugeAndBinaryOutput(t *testing.T) {
	e := newEnv(t, envOpts{})
	r := e.run(t.Context(), "head -c 20000000 /dev/urandom | tee /dev/stderr | sha256sum >/dev/null; head -c 5000000 /dev/zero")
	if r.err != nil || r.end == nil || len(r.stderr) != 20_000_000 || len(r.stdout) != 5_000_000 {
		t.Fatalf("stdout %d stderr %d end %v err %v", len(r.stdout), len(r.stderr), r.end, r.err)
	}
	for _, ev := range r.events {
		if d := ev.GetData(); d != nil && len(d.GetStdout())+len(d.GetStderr()) > 32*1024 {
			t.Fatal("chunk larger than 32 KiB")
		}
	}
}

// Two attached clients both receive the output.
func TestTwoSubscribers(t *testing.T) {
	e := newEnv(t, envOpts{})
	s, err := e.proc.Start(t.Context(), connect.NewRequest(&pb.StartRequest{
		Process: &pb.ProcessConfig{Cmd: "/bin/sh", Args: []string{"-c", "sleep 0.3; seq 1 1000"}}}))
	if err != nil {
		t.Fatal(err)
	}
	s.Receive()
	pid := s.Msg().GetEvent().GetStart().GetPid()
	c, err := e.proc.Connect(t.Context(), connect.NewRequest(&pb.ConnectRequest{Process: &pb.ProcessSelector{Selector: &pb.ProcessSelector_Pid{Pid: pid}}}))
	if err != nil {
		t.Fatal(err)
	}
	ch := make(chan result, 1)
	go func() { ch <- collect[*pb.ConnectResponse](c) }()
	r1 := collect[*pb.StartResponse](s)
	r2 := <-ch
	if !bytes.Equal(r1.stdout, r2.stdout) || !bytes.HasSuffix(r1.stdout, []byte("1000\n")) || r2.end == nil {
		t.Fatalf("start got %d bytes, connect got %d", len(r1.stdout), len(r2.stdout))
	}
}

func TestListEmptyAndMalformedEnvelope(t *testing.T) {
	e := newEnv(t, envOpts{})
	l, err := e.proc.List(t.Context(), connect.NewRequest(&pb.ListRequest{}))
	if err != nil || len(l.Msg.Processes) != 0 {
		t.Fatalf("%v %v", l, err)
	}
	for _, body := range []string{"", "\x00\x00\x00\x00\x05{", "\x00\xff\xff\xff\xff{}", "\x01\x00\x00\x00\x02{}", "garbage", "\x00\x00\x00\x00\x02[]"} {
		resp, err := http.Post(e.url+"/process.Process/Connect", "application/connect+json", strings.NewReader(body))
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode == 200 && !bytes.Contains(b, []byte(`"error"`)) {
			t.Fatalf("body %q: %d %q", body, resp.StatusCode, b)
		}
	}
	// Still serving.
	if r := e.run(t.Context(), "echo ok"); string(r.stdout) != "ok\n" {
		t.Fatalf("%+v", r)
	}
}
