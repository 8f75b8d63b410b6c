package oci

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/aenv-dev/aenv/internal/sandbox"
)

func TestLaunchReachStop(t *testing.T) {
	for _, mode := range []string{UserNSAuto, UserNSOff} {
		t.Run("userns="+mode, func(t *testing.T) { testLaunchReachStop(t, mode) })
	}
}

func testLaunchReachStop(t *testing.T, mode string) {
	e := newTestBackend(t, func(c *Config) { c.UserNamespace = mode })
	if mode == UserNSOff && e.b.UserNamespaces() {
		t.Fatal("UserNamespace=off but the backend uses one")
	}
	ctx := context.Background()
	i := e.launch(t, "life1", sandbox.Resources{CPUCount: 1, MemoryMB: 128, DiskSizeMB: 512})
	t.Logf("runtime=%s userns=%v ip=%s", e.b.Runtime(), e.b.UserNamespaces(), i.Endpoint().Host)

	out, code := e.sh(t, i, "/bin/bash -l -c 'id -u; echo $PATH; test -x /.aenv/envd && echo envd-present; cat /proc/1/cmdline | tr \"\\0\" \" \"'")
	if code != 0 || !strings.HasPrefix(out, "0\n/usr/local/sbin:") || !strings.Contains(out, "envd-present") {
		t.Fatalf("exec: code %d out %q", code, out)
	}
	if want := e.b.cfg.ResolvConf; want != "" {
		host, _ := os.ReadFile(want)
		if out, _ := e.sh(t, i, "cat /etc/resolv.conf"); out != string(host) {
			t.Fatalf("resolv.conf %q, want the host's %q", out, host)
		}
	}
	st, err := i.Stats(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if st.MemUsed <= 0 || st.MemTotal != 128<<20 || st.CPUCount != 1 || st.DiskTotal != 512<<20 || st.DiskUsed <= 0 {
		t.Fatalf("stats %+v", st)
	}
	slot := i.slot
	if err := i.Stop(ctx); err != nil {
		t.Fatal(err)
	}
	if err := i.Stop(ctx); err != nil {
		t.Fatalf("second stop: %v", err)
	}
	if _, err := i.Stats(ctx); !errors.Is(err, sandbox.ErrGone) {
		t.Fatalf("stats after stop: %v", err)
	}
	assertGone(t, e.b, i.id, slot)
}

// TestRealEnvd runs the repository's envd as init and reaches it from the host.
func TestRealEnvd(t *testing.T) {
	needRuntime(t)
	envd := testEnvd(t)
	if envd == "" {
		t.Skip("cmd/envd does not build or does not answer --help yet")
	}
	e := newTestBackend(t, func(c *Config) { c.EnvdPath, c.InitArgs = envd, nil })
	i := e.launch(t, "envd1", sandbox.Resources{CPUCount: 1, MemoryMB: 256})
	if err := probeHealth(i, time.Second); err != nil {
		t.Fatal(err)
	}
}

// TestConcurrentLaunchStop launches and stops sandboxes from many goroutines at once, as
// a fork fan-out or a burst of creates does.
func TestConcurrentLaunchStop(t *testing.T) {
	e := newTestBackend(t, nil)
	const n = 8
	insts := make([]*Instance, n)
	errs := make(chan error, n)
	for k := 0; k < n; k++ {
		go func() {
			inst, err := e.b.Launch(context.Background(), sandbox.LaunchPlan{
				Kind: sandbox.LaunchFresh, SandboxID: fmt.Sprintf("conc%d", k),
				RootFS: sandbox.RootFS{LowerDir: e.template}, Resources: sandbox.Resources{CPUCount: 1, MemoryMB: 64},
			})
			if err == nil {
				insts[k] = inst.(*Instance)
			}
			errs <- err
		}()
	}
	for k := 0; k < n; k++ {
		if err := <-errs; err != nil {
			t.Fatal(err)
		}
	}
	ips := map[string]bool{}
	for _, i := range insts {
		e.waitReady(t, i)
		ips[i.Endpoint().Host] = true
	}
	if len(ips) != n {
		t.Fatalf("%d distinct addresses for %d sandboxes", len(ips), n)
	}
	for _, i := range insts {
		go func() {
			slot := i.slot
			err := i.Stop(context.Background())
			if err == nil {
				assertGone(t, e.b, i.id, slot)
			}
			errs <- err
		}()
	}
	for k := 0; k < n; k++ {
		if err := <-errs; err != nil {
			t.Fatal(err)
		}
	}
}
