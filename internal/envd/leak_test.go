package envd_test

import (
	"os"
	"runtime"
	"testing"
	"time"

	"connectrpc.com/connect"

	pb "github.com/aenv-dev/aenv/internal/envd/gen/process"
)

func openFDs(t *testing.T) int {
	des, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Skip("no /proc/self/fd")
	}
	return len(des)
}

// 10 000 short commands (pipes, stdin pipes, PTYs, abandoned streams) leave no goroutines or
// descriptors behind.
func TestNoLeaksAfterManyCommands(t *testing.T) {
	n := 10000
	if testing.Short() {
		n = 500
	}
	e := newEnv(t, envOpts{})
	run := func(i int) {
		req := &pb.StartRequest{Process: &pb.ProcessConfig{Cmd: "/bin/true"}}
		switch {
		case i%50 == 0:
			req.Pty = &pb.PTY{Size: &pb.PTY_Size{Cols: 80, Rows: 24}}
		case i%10 == 0:
			req.Stdin = ptr(true)
		default:
			req.Stdin = ptr(false)
		}
		s, err := e.proc.Start(t.Context(), connect.NewRequest(req))
		if err != nil {
			t.Fatal(err)
		}
		if i%25 == 0 { // client walks away after the start event
			s.Receive()
			s.Close()
			return
		}
		r := collect[*pb.StartResponse](s)
		if r.err != nil || r.end == nil || r.end.ExitCode != 0 {
			t.Fatalf("command %d: %+v", i, r)
		}
	}
	for i := 1; i <= 20; i++ { // warm up: connections, pools, the finished-process list
		run(i)
	}
	settle := func() (int, int) {
		time.Sleep(100 * time.Millisecond)
		runtime.GC()
		return runtime.NumGoroutine(), openFDs(t)
	}
	g0, f0 := settle()
	for i := 1; i <= n; i++ {
		run(i)
	}
	var g, f int
	for try := 0; try < 50; try++ {
		if g, f = settle(); g <= g0+2 && f <= f0+2 {
			break
		}
	}
	t.Logf("%d commands: goroutines %d -> %d, fds %d -> %d, running %d", n, g0, g, f0, f, e.srv.Process.Running())
	if g > g0+2 || f > f0+2 {
		buf := make([]byte, 1<<20)
		t.Fatalf("leak: goroutines %d -> %d, fds %d -> %d\n%s", g0, g, f0, f, buf[:runtime.Stack(buf, true)])
	}
}
