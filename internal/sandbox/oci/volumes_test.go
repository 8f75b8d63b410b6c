package oci

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/aenv-dev/aenv/internal/sandbox"
)

// TestVolumeMountedAfterTemplate checks that a volume whose filesystem the host mounted
// after the launch template was built is the one the sandbox sees: on a host whose
// mounts are private nothing reaches the template, so the runtime must bind the volume
// from a mount cloned at launch time, not from its path in the template.
func TestVolumeMountedAfterTemplate(t *testing.T) {
	for _, mode := range []string{UserNSAuto, UserNSOff} {
		t.Run("userns="+mode, func(t *testing.T) { testVolumeMountedAfterTemplate(t, mode) })
	}
}

func testVolumeMountedAfterTemplate(t *testing.T, mode string) {
	e := newTestBackend(t, func(c *Config) { c.UserNamespace = mode })
	ns := e.b.rt.ns
	if ns == nil {
		t.Skip("the runtime runs in the host's mount namespace here")
	}
	ns.mu.Lock()
	ns.maxAge = time.Hour
	ns.mu.Unlock()
	e.launch(t, "vol-a", sandbox.Resources{}) // builds the template
	ns.mu.Lock()
	built := ns.tmpl
	ns.mu.Unlock()
	if built == nil {
		t.Fatal("no template after a launch")
	}

	// The volume's filesystem, mounted now, outside the data directory.
	fs := filepath.Join(t.TempDir(), "fs")
	if err := os.MkdirAll(fs, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := unix.Mount("tmpfs", fs, "tmpfs", 0, "size=1m,mode=0777"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = unix.Unmount(fs, unix.MNT_DETACH) })
	data := filepath.Join(fs, "data")
	if err := os.MkdirAll(data, 0o777); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(data, "hello"), []byte("from the host\n"), 0o644); err != nil {
		t.Fatal(err)
	}

	inst, err := e.b.Launch(context.Background(), sandbox.LaunchPlan{
		Kind: sandbox.LaunchFresh, SandboxID: "vol-b", RootFS: sandbox.RootFS{LowerDir: e.template},
		AllowInternet: true, Mounts: []sandbox.Mount{{Source: data, Destination: "/mnt/vol"}},
	})
	if err != nil {
		t.Fatal(err)
	}
	i := inst.(*Instance)
	e.waitReady(t, i)
	ns.mu.Lock()
	same := ns.tmpl == built
	ns.mu.Unlock()
	if !same {
		t.Fatal("the second launch built a new template: the test shows nothing")
	}
	out, code := e.sh(t, i, "cat /mnt/vol/hello && echo written > /mnt/vol/back")
	if code != 0 || strings.TrimSpace(out) != "from the host" {
		t.Fatalf("volume in the sandbox: exit %d, %q", code, out)
	}
	if b, err := os.ReadFile(filepath.Join(data, "back")); err != nil || string(b) != "written\n" {
		t.Errorf("the sandbox's write on the host: %q, %v", b, err)
	}
}
