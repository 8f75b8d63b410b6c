package microvm

import (
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

func TestCmdline(t *testing.T) {
	p := bootParams{
		ip: netip.MustParsePrefix("10.91.7.2/24"), gateway: netip.MustParseAddr("10.91.7.1"),
		hostname: "sbx", dns: []string{"1.1.1.1", "8.8.8.8"}, envdPort: 49983,
	}
	got := p.cmdline()
	for _, want := range []string{"console=ttyS0", "aenv.ip=10.91.7.2/24", "aenv.gw=10.91.7.1",
		"aenv.hostname=sbx", "aenv.dns=1.1.1.1,8.8.8.8", "aenv.port=49983", "panic=1"} {
		if !strings.Contains(" "+got+" ", " "+want+" ") {
			t.Errorf("cmdline %q lacks %q", got, want)
		}
	}
	if strings.Contains(bootParams{}.cmdline(), "aenv.") {
		t.Errorf("empty params give %q", bootParams{}.cmdline())
	}
}

func TestNameservers(t *testing.T) {
	f := filepath.Join(t.TempDir(), "resolv.conf")
	os.WriteFile(f, []byte("# x\nnameserver 127.0.0.53\nnameserver 10.0.0.2\nnameserver ::1\nnameserver fd00::1\nsearch lan\nnameserver 9.9.9.9\n"), 0o644)
	if got := strings.Join(nameservers(f), ","); got != "10.0.0.2,9.9.9.9" {
		t.Errorf("nameservers %q", got)
	}
	if got := nameservers(filepath.Join(t.TempDir(), "missing")); got != nil {
		t.Errorf("missing file gives %v", got)
	}
}

// TestBuildInitrd checks the appended archive with a real cpio reader (busybox).
func TestBuildInitrd(t *testing.T) {
	if _, err := os.Stat("/bin/busybox"); err != nil {
		t.Skip("needs /bin/busybox (busybox-static)")
	}
	dir := t.TempDir()
	base, envd, out := filepath.Join(dir, "base.img"), filepath.Join(dir, "envd"), filepath.Join(dir, "initrd.img")
	os.WriteFile(envd, []byte("#!/bin/sh\necho envd\n"), 0o755)
	src := filepath.Join(dir, "src")
	os.MkdirAll(filepath.Join(src, "bin"), 0o755)
	os.WriteFile(filepath.Join(src, "init"), []byte("init"), 0o755)
	cmd := exec.Command("sh", "-c", "cd "+src+" && find . | /bin/busybox cpio -o -H newc > "+base)
	if b, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("cpio: %v: %s", err, b)
	}
	if err := buildInitrd(base, envd, out); err != nil {
		t.Fatal(err)
	}
	x := filepath.Join(dir, "x")
	os.Mkdir(x, 0o755)
	// busybox cpio stops at the first trailer, so read the appended archive on its own,
	// as the kernel does after the first one.
	raw, _ := os.ReadFile(out)
	braw, _ := os.ReadFile(base)
	off := (len(braw) + 3) / 4 * 4
	os.WriteFile(filepath.Join(dir, "second.cpio"), raw[off:], 0o644)
	cmd = exec.Command("/bin/busybox", "cpio", "-i", "-F", filepath.Join(dir, "second.cpio"))
	cmd.Dir = x
	if b, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("cpio -i: %v: %s", err, b)
	}
	got, err := os.ReadFile(filepath.Join(x, "envd"))
	if err != nil || string(got) != "#!/bin/sh\necho envd\n" {
		t.Fatalf("envd in the archive: %q %v", got, err)
	}
	if fi, _ := os.Stat(filepath.Join(x, "envd")); fi.Mode().Perm() != 0o755 {
		t.Errorf("envd mode %v", fi.Mode())
	}
	if err := buildInitrd(filepath.Join(dir, "missing"), envd, out); err == nil {
		t.Error("missing base initramfs accepted")
	}
}
