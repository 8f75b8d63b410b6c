package envdclient_test

import (
	"bytes"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"os/user"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/proto"

	"github.com/aenv-dev/aenv/internal/envd"
	"github.com/aenv-dev/aenv/internal/envd/gen/process"
	"github.com/aenv-dev/aenv/internal/envd/identity"
	"github.com/aenv-dev/aenv/internal/envd/state"
	"github.com/aenv-dev/aenv/internal/envdclient"
)

const token = "secret-token"

// server is a real envd behind httptest; it records the headers of the last request so
// tests can see what the client sent, the way a node's proxy would.
type server struct {
	url string
	hc  *http.Client
	mu  sync.Mutex
	hdr http.Header
}

func (s *server) lastHeader() http.Header {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.hdr
}

func newServer(t *testing.T) *server {
	t.Helper()
	u, err := user.Current()
	if err != nil {
		t.Fatal(err)
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
	defaults := state.New(u.Username)
	tok := token
	defaults.Apply(state.Init{AccessToken: &tok})
	srv := envd.New(envd.Config{Users: identity.DB{PasswdPath: pw, GroupPath: gr}, Defaults: defaults, DiskPath: dir})
	s := &server{}
	hs := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		s.mu.Lock()
		s.hdr = r.Header.Clone()
		s.mu.Unlock()
		srv.ServeHTTP(w, r)
	}))
	t.Cleanup(func() {
		srv.Process.SignalAll(9)
		hs.CloseClientConnections()
		hs.Close()
		srv.Close()
	})
	s.url, s.hc = hs.URL, hs.Client()
	return s
}

func bash(script string) envdclient.Command {
	return envdclient.Command{Cmd: "/bin/bash", Args: []string{"-c", script}}
}

func TestStartAndWait(t *testing.T) {
	s := newServer(t)
	c := envdclient.New(s.hc, s.url, envdclient.WithAccessToken(token), envdclient.WithSandbox("sbx1", "49983"))
	tests := []struct {
		name           string
		cmd            envdclient.Command
		stdout, stderr string
		code           int32
		exited         bool
		status         string
	}{
		{name: "output", cmd: bash("echo out; echo err >&2"), stdout: "out\n", stderr: "err\n", exited: true, status: "exit status 0"},
		{name: "non-zero exit", cmd: bash("echo partial; exit 3"), stdout: "partial\n", code: 3, exited: true, status: "exit status 3"},
		{name: "signal", cmd: bash("kill -9 $$"), code: -1, status: "signal: killed"},
		{name: "cwd and env", cmd: envdclient.Command{Cmd: "/bin/bash", Args: []string{"-c", "pwd; echo $V"}, Cwd: "/tmp", Env: map[string]string{"V": "x"}},
			stdout: "/tmp\nx\n", exited: true, status: "exit status 0"},
		{name: "stdin closed", cmd: bash("cat; echo done"), stdout: "done\n", exited: true, status: "exit status 0"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			p, err := c.Start(t.Context(), tt.cmd)
			if err != nil {
				t.Fatal(err)
			}
			defer p.Close()
			if p.Pid == 0 {
				t.Fatal("no pid from the start event")
			}
			var stdout, stderr bytes.Buffer
			end, err := p.Wait(&stdout, &stderr)
			if err != nil {
				t.Fatal(err)
			}
			if stdout.String() != tt.stdout || stderr.String() != tt.stderr {
				t.Errorf("stdout %q stderr %q, want %q %q", stdout.String(), stderr.String(), tt.stdout, tt.stderr)
			}
			if end.GetExitCode() != tt.code || end.GetExited() != tt.exited || end.GetStatus() != tt.status {
				t.Errorf("end = %v, want code %d exited %v status %q", end, tt.code, tt.exited, tt.status)
			}
			h := s.lastHeader()
			if h.Get("X-Access-Token") != token || h.Get("E2b-Sandbox-Id") != "sbx1" || h.Get("E2b-Sandbox-Port") != "49983" {
				t.Errorf("headers = %v", h)
			}
		})
	}
}

func TestHeaders(t *testing.T) {
	s := newServer(t)
	tests := []struct {
		name string
		opts []envdclient.Option
		want map[string]string // "" means absent
	}{
		{name: "token only", opts: []envdclient.Option{envdclient.WithAccessToken(token)},
			want: map[string]string{"X-Access-Token": token, "E2b-Sandbox-Id": "", "E2b-Sandbox-Port": ""}},
		{name: "through a proxy", opts: []envdclient.Option{envdclient.WithAccessToken(token), envdclient.WithSandbox("abc", "1234")},
			want: map[string]string{"X-Access-Token": token, "E2b-Sandbox-Id": "abc", "E2b-Sandbox-Port": "1234"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c := envdclient.New(s.hc, s.url, tt.opts...)
			// A unary call must carry the same headers as Start: the CLI signals through it.
			if _, err := c.Proc.List(t.Context(), connect.NewRequest(&process.ListRequest{})); err != nil {
				t.Fatal(err)
			}
			h := s.lastHeader()
			for k, v := range tt.want {
				if h.Get(k) != v {
					t.Errorf("%s = %q, want %q", k, h.Get(k), v)
				}
			}
			var plain http.Header = http.Header{}
			c.SetHeaders(plain)
			for k, v := range tt.want {
				if plain.Get(k) != v {
					t.Errorf("SetHeaders: %s = %q, want %q", k, plain.Get(k), v)
				}
			}
		})
	}
}

func TestUserAndTag(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root to run as another user")
	}
	s := newServer(t)
	c := envdclient.New(s.hc, s.url, envdclient.WithAccessToken(token))
	cmd := bash("id -u; sleep 30")
	cmd.User, cmd.Tag = "root", "my-tag"
	p, err := c.Start(t.Context(), cmd)
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	if got := s.lastHeader().Get("Authorization"); got != "Basic cm9vdDo=" {
		t.Errorf("Authorization = %q", got)
	}
	list, err := c.Proc.List(t.Context(), connect.NewRequest(&process.ListRequest{}))
	if err != nil {
		t.Fatal(err)
	}
	found := false
	for _, pi := range list.Msg.GetProcesses() {
		found = found || (pi.GetPid() == p.Pid && pi.GetTag() == "my-tag")
	}
	if !found {
		t.Errorf("process %d with tag my-tag not listed: %v", p.Pid, list.Msg.GetProcesses())
	}
}

func TestErrors(t *testing.T) {
	s := newServer(t)
	tests := []struct {
		name string
		opts []envdclient.Option
		cmd  envdclient.Command
		code connect.Code
		text string
	}{
		{name: "no token", cmd: bash("true"), code: connect.CodeUnauthenticated},
		{name: "wrong token", opts: []envdclient.Option{envdclient.WithAccessToken("nope")}, cmd: bash("true"), code: connect.CodeUnauthenticated},
		{name: "unknown user", opts: []envdclient.Option{envdclient.WithAccessToken(token)},
			cmd: envdclient.Command{Cmd: "/bin/true", User: "nobodyx"}, code: connect.CodeUnauthenticated, text: "nobodyx"},
		{name: "missing cwd", opts: []envdclient.Option{envdclient.WithAccessToken(token)},
			cmd: envdclient.Command{Cmd: "/bin/true", Cwd: "/does/not/exist"}, code: connect.CodeInvalidArgument, text: "does not exist"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c := envdclient.New(s.hc, s.url, tt.opts...)
			p, err := c.Start(t.Context(), tt.cmd)
			if err == nil {
				p.Close()
				t.Fatal("started")
			}
			var recvErr *envdclient.ReceiveError
			if !errors.As(err, &recvErr) {
				t.Errorf("error %T is not a *ReceiveError", err)
			}
			if connect.CodeOf(err) != tt.code || !strings.Contains(err.Error(), tt.text) {
				t.Errorf("err = %v (code %v), want code %v containing %q", err, connect.CodeOf(err), tt.code, tt.text)
			}
		})
	}
	t.Run("unreachable", func(t *testing.T) {
		c := envdclient.New(s.hc, "http://127.0.0.1:1", envdclient.WithAccessToken(token))
		if _, err := c.Start(t.Context(), bash("true")); connect.CodeOf(err) != connect.CodeUnavailable {
			t.Errorf("err = %v, want unavailable", err)
		}
	})
	t.Run("stream ends before start", func(t *testing.T) {
		hs := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			w.Header().Set("Content-Type", "application/connect+proto")
			_, _ = w.Write([]byte{2, 0, 0, 0, 2, '{', '}'}) // end-of-stream, no events
		}))
		defer hs.Close()
		c := envdclient.New(hs.Client(), hs.URL)
		if _, err := c.Start(t.Context(), bash("true")); !errors.Is(err, envdclient.ErrNoStart) {
			t.Errorf("err = %v, want ErrNoStart", err)
		}
	})
	t.Run("stream ends before end", func(t *testing.T) {
		hs := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			w.Header().Set("Content-Type", "application/connect+proto")
			start, err := proto.Marshal(&process.StartResponse{Event: &process.ProcessEvent{
				Event: &process.ProcessEvent_Start{Start: &process.ProcessEvent_StartEvent{Pid: 7}}}})
			if err != nil {
				panic(err)
			}
			_, _ = w.Write(append([]byte{0, 0, 0, 0, byte(len(start))}, start...))
			_, _ = w.Write([]byte{2, 0, 0, 0, 2, '{', '}'})
		}))
		defer hs.Close()
		c := envdclient.New(hs.Client(), hs.URL)
		p, err := c.Start(t.Context(), bash("true"))
		if err != nil {
			t.Fatal(err)
		}
		defer p.Close()
		if p.Pid != 7 {
			t.Errorf("pid = %d", p.Pid)
		}
		if _, err := p.Wait(nil, nil); !errors.Is(err, envdclient.ErrNoEnd) {
			t.Errorf("err = %v, want ErrNoEnd", err)
		}
	})
}

// A tagged process outlives the stream that started it; Connect re-attaches by tag
// (output from then on, then the end) and, once it finished, by pid (start and end only).
func TestConnect(t *testing.T) {
	s := newServer(t)
	c := envdclient.New(s.hc, s.url, envdclient.WithAccessToken(token))
	gate := filepath.Join(t.TempDir(), "gate")
	// Started on the raw stream, read up to its first output, so that output is surely
	// published before Connect subscribes.
	tag := "svc"
	first, err := c.Proc.Start(t.Context(), connect.NewRequest(&process.StartRequest{Tag: &tag, Process: &process.ProcessConfig{
		Cmd: "/bin/bash", Args: []string{"-c", "echo before; while [ ! -e " + gate + " ]; do sleep 0.02; done; echo after; echo oops >&2; exit 4"}}}))
	if err != nil {
		t.Fatal(err)
	}
	var pid uint32
	for first.Receive() && !bytes.Equal(first.Msg().GetEvent().GetData().GetStdout(), []byte("before\n")) {
		if st := first.Msg().GetEvent().GetStart(); st != nil {
			pid = st.GetPid()
		}
	}
	first.Close()
	if pid == 0 {
		t.Fatalf("no start event or no first output: %v", first.Err())
	}

	r, err := c.Connect(t.Context(), envdclient.Selector{Tag: "svc"})
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	if r.Pid != pid {
		t.Fatalf("re-attached to pid %d, want %d", r.Pid, pid)
	}
	if err := os.WriteFile(gate, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	var stdout, stderr bytes.Buffer
	end, err := r.Wait(&stdout, &stderr)
	if err != nil {
		t.Fatal(err)
	}
	if stdout.String() != "after\n" || stderr.String() != "oops\n" || end.GetExitCode() != 4 {
		t.Fatalf("re-attached output %q %q end %v, want the output after re-attaching and exit 4", stdout.String(), stderr.String(), end)
	}

	done, err := c.Connect(t.Context(), envdclient.Selector{Pid: pid})
	if err != nil {
		t.Fatal(err)
	}
	defer done.Close()
	stdout.Reset()
	if end, err := done.Wait(&stdout, nil); err != nil || end.GetExitCode() != 4 || stdout.Len() != 0 {
		t.Fatalf("connect to the finished process: end %v err %v output %q", end, err, stdout.String())
	}

	if _, err := c.Connect(t.Context(), envdclient.Selector{Tag: "nothing"}); connect.CodeOf(err) != connect.CodeNotFound {
		t.Fatalf("connect to an unknown tag: %v, want not found", err)
	}
	if _, err := c.Connect(t.Context(), envdclient.Selector{}); !errors.Is(err, envdclient.ErrNoSelector) {
		t.Fatalf("connect without a selector: %v", err)
	}
}
