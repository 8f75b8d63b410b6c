package envd_test

import (
	"context"
	"crypto/tls"
	"fmt"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"testing"
	"time"

	"connectrpc.com/connect"

	"github.com/aenv-dev/aenv/internal/envd"
	"github.com/aenv-dev/aenv/internal/envd/gen/filesystem/filesystemconnect"
	pb "github.com/aenv-dev/aenv/internal/envd/gen/process"
	"github.com/aenv-dev/aenv/internal/envd/gen/process/processconnect"
	"github.com/aenv-dev/aenv/internal/envd/identity"
	"github.com/aenv-dev/aenv/internal/envd/state"
)

const testUID = 4242 // the `user` account of the test passwd file

// env is one envd under test: a real HTTP server on loopback and Connect clients for it.
type env struct {
	t     testing.TB
	srv   *envd.Server
	hs    *httptest.Server
	url   string
	dir   string // scratch directory; the test user's home is dir/home/user
	home  string
	user  string // default user ("user" when root, else the current user)
	proc  processconnect.ProcessClient
	fs    filesystemconnect.FilesystemClient
	token string
}

type envOpts struct {
	token        string // set an access token via Defaults
	randomDevice string // Config.RandomDevice
}

func isRoot() bool { return os.Geteuid() == 0 }

// newEnv starts envd with its own passwd/group: root plus, when the tests run as root, `user`
// (uid 4242) with a home under a temp dir, which is the default user.
func newEnv(t *testing.T, o envOpts) *env { return newEnvOpts(t, o) }

func newEnvTB(tb testing.TB) *env { return newEnvOpts(tb, envOpts{}) }

func newEnvOpts(t testing.TB, o envOpts) *env {
	t.Helper()
	dir := t.TempDir()
	// t.TempDir's parent is 0700; the test user must be able to reach its home.
	for _, d := range []string{filepath.Dir(dir), dir} {
		if err := os.Chmod(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	home := filepath.Join(dir, "home", "user")
	if err := os.MkdirAll(home, 0o755); err != nil {
		t.Fatal(err)
	}
	name := "user"
	uid := testUID
	if !isRoot() {
		uid = os.Geteuid()
		name = fmt.Sprintf("u%d", uid)
	} else if err := os.Chown(home, uid, uid); err != nil {
		t.Fatal(err)
	}
	passwd := fmt.Sprintf("root:x:0:0:root:/root:/bin/sh\n%s:x:%d:%d:test user:%s:/bin/sh\n", name, uid, uid, home)
	group := fmt.Sprintf("root:x:0:\n%s:x:%d:\nextra:x:4343:%s\n", name, uid, name)
	pw, gr := filepath.Join(dir, "passwd"), filepath.Join(dir, "group")
	if err := os.WriteFile(pw, []byte(passwd), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(gr, []byte(group), 0o644); err != nil {
		t.Fatal(err)
	}
	defaults := state.New(name)
	if o.token != "" {
		tok := o.token
		defaults.Apply(state.Init{AccessToken: &tok})
	}
	srv := envd.New(envd.Config{Users: identity.DB{PasswdPath: pw, GroupPath: gr}, Defaults: defaults, DiskPath: dir, RandomDevice: o.randomDevice})
	hs := httptest.NewUnstartedServer(srv)
	p := new(http.Protocols)
	p.SetHTTP1(true)
	p.SetUnencryptedHTTP2(true)
	hs.Config.Protocols = p
	hs.Start()
	e := &env{t: t, srv: srv, hs: hs, url: hs.URL, dir: dir, home: home, user: name, token: o.token}
	e.proc = processconnect.NewProcessClient(e.httpClient(), hs.URL, connect.WithInterceptors(e.tokenInterceptor()))
	e.fs = filesystemconnect.NewFilesystemClient(e.httpClient(), hs.URL, connect.WithInterceptors(e.tokenInterceptor()))
	t.Cleanup(func() {
		// Kill whatever a test left running, then stop the server.
		srv.Process.SignalAll(9)
		deadline := time.Now().Add(5 * time.Second)
		for srv.Process.Running() > 0 && time.Now().Before(deadline) {
			time.Sleep(10 * time.Millisecond)
		}
		hs.CloseClientConnections()
		hs.Close()
		srv.Close()
	})
	return e
}

func (e *env) httpClient() *http.Client { return e.hs.Client() }

// h2cClient speaks HTTP/2 without TLS (for the gRPC protocol).
func (e *env) h2cClient() *http.Client {
	p := new(http.Protocols)
	p.SetUnencryptedHTTP2(true)
	return &http.Client{Transport: &http.Transport{
		Protocols:       p,
		TLSClientConfig: &tls.Config{},
		DialContext:     (&net.Dialer{}).DialContext,
	}}
}

type tokenInterceptor struct{ e *env }

func (e *env) tokenInterceptor() connect.Interceptor { return tokenInterceptor{e} }

func (i tokenInterceptor) WrapUnary(next connect.UnaryFunc) connect.UnaryFunc {
	return func(ctx context.Context, req connect.AnyRequest) (connect.AnyResponse, error) {
		if i.e.token != "" && req.Header().Get("X-Access-Token") == "" {
			req.Header().Set("X-Access-Token", i.e.token)
		}
		return next(ctx, req)
	}
}

func (i tokenInterceptor) WrapStreamingClient(next connect.StreamingClientFunc) connect.StreamingClientFunc {
	return func(ctx context.Context, spec connect.Spec) connect.StreamingClientConn {
		conn := next(ctx, spec)
		if i.e.token != "" {
			conn.RequestHeader().Set("X-Access-Token", i.e.token)
		}
		return conn
	}
}

func (i tokenInterceptor) WrapStreamingHandler(next connect.StreamingHandlerFunc) connect.StreamingHandlerFunc {
	return next
}

// result is what a Start/Connect stream produced.
type result struct {
	pid        uint32
	stdout     []byte
	stderr     []byte
	pty        []byte
	keepalives int
	end        *pb.ProcessEvent_EndEvent
	events     []*pb.ProcessEvent
	err        error
}

// collect drains a stream of events.
func collect[T interface{ GetEvent() *pb.ProcessEvent }](s interface {
	Receive() bool
	Msg() T
	Err() error
}) result {
	var r result
	for s.Receive() {
		ev := s.Msg().GetEvent()
		r.events = append(r.events, ev)
		switch {
		case ev.GetStart() != nil:
			r.pid = ev.GetStart().GetPid()
		case ev.GetData() != nil:
			d := ev.GetData()
			r.stdout = append(r.stdout, d.GetStdout()...)
			r.stderr = append(r.stderr, d.GetStderr()...)
			r.pty = append(r.pty, d.GetPty()...)
		case ev.GetKeepalive() != nil:
			r.keepalives++
		case ev.GetEnd() != nil:
			r.end = ev.GetEnd()
		}
	}
	r.err = s.Err()
	return r
}

// run starts bash -c script and collects everything.
func (e *env) run(ctx context.Context, script string, mods ...func(*connect.Request[pb.StartRequest])) result {
	e.t.Helper()
	f := false
	req := connect.NewRequest(&pb.StartRequest{
		Process: &pb.ProcessConfig{Cmd: "/bin/bash", Args: []string{"-c", script}},
		Stdin:   &f,
	})
	for _, m := range mods {
		m(req)
	}
	s, err := e.proc.Start(ctx, req)
	if err != nil {
		return result{err: err}
	}
	defer s.Close()
	return collect[*pb.StartResponse](s)
}

func codeOf(err error) connect.Code { return connect.CodeOf(err) }

func mkdir(p string) error              { return os.MkdirAll(p, 0o755) }
func writeFile(p, content string) error { return os.WriteFile(p, []byte(content), 0o644) }
