package oci

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/aenv-dev/aenv/internal/sandbox"
)

// TestSeccompVsock: a sandbox cannot open an AF_VSOCK socket (EPERM from the seccomp
// profile) while AF_INET sockets keep working. Where the host itself can open one, the
// kernel would have let the sandbox too, so only EPERM passes there.
func TestSeccompVsock(t *testing.T) {
	e := newTestBackend(t, nil)
	goBin, err := exec.LookPath("go")
	if err != nil {
		t.Skip("no go toolchain on PATH to build the probe: ", err)
	}
	probe := filepath.Join(t.TempDir(), "vsockprobe")
	build := exec.Command(goBin, "build", "-o", probe, "./testdata/vsockprobe")
	build.Env = append(os.Environ(), "CGO_ENABLED=0")
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("build the probe: %v\n%s", err, out)
	}
	hostHasVsock := false
	if fd, err := unix.Socket(unix.AF_VSOCK, unix.SOCK_STREAM, 0); err == nil {
		unix.Close(fd)
		hostHasVsock = true
	}

	a := e.launch(t, "vsock-a", sandbox.Resources{CPUCount: 1, MemoryMB: 128})
	// A name the sandbox never looked up, so its overlay finds the file in the upper dir.
	bin, err := os.ReadFile(probe)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(a.l.upper(), "vsockprobe"), bin, 0o755); err != nil {
		t.Fatal(err)
	}
	out, code := e.sh(t, a, "/vsockprobe")
	if code != 0 || !strings.Contains(out, "inet=ok") {
		t.Fatalf("probe: exit %d: %s", code, out)
	}
	switch {
	case strings.Contains(out, "vsock=EPERM"):
	case !hostHasVsock && strings.Contains(out, "vsock=EAFNOSUPPORT"):
		t.Logf("the host has no AF_VSOCK either: %s", out)
	default:
		t.Fatalf("the sandbox opened or was refused an AF_VSOCK socket unexpectedly (host has vsock: %v): %s", hostHasVsock, out)
	}
}
