package oci

import (
	"context"
	"errors"
		"strings"
	"testing"
	"time"

	"github.com/aenv-dev/aenv/internal/sandbox"
)

func TestLaunchReachStop(t *testing.T) {
	e := newTestBackend(t, nil)
	ctx := context.Background()
	i := e.launch(t, "life1", sandbox.Resources{CPUCount: 1, MemoryMB: 128, DiskSizeMB: 512})
	t.Logf("runtime=%s userns=%v ip=%s", e.b.Runtime(), e.b.UserNamespaces(), i.Endpoint().Host)

	out, code := e.sh(t, i, "/bin/bash -l -c 'id -u; echo $PATH; test -x /.aenv/envd && echo envd-present; cat /proc/1/cmdline | tr \"\\0\" \" \"'")
	if code != 0 || !strings.HasPrefix(out, "0\n/usr/local/sbin:") || !strings.Contains(out, "envd-present") {
		t.Fatalf("exec: code %d out %q", code, out)
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
