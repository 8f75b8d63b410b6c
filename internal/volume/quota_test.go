package volume

import (
	"bytes"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"testing"

	"golang.org/x/sys/unix"
)

// needsLoopMounts skips unless volumes with a quota can be made here (root, mkfs.ext4,
// loop devices).
func needsLoopMounts(t *testing.T) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root to loop-mount volume images")
	}
	if _, err := exec.LookPath("mkfs.ext4"); err != nil {
		t.Skip("needs mkfs.ext4 (e2fsprogs)")
	}
	if _, err := os.Stat("/dev/loop-control"); err != nil {
		t.Skip("needs loop devices (/dev/loop-control)")
	}
}

func TestQuota(t *testing.T) {
	needsLoopMounts(t)
	dir := t.TempDir()
	if _, err := Open(dir, Options{SizeMB: MinSizeMB - 1}); err == nil {
		t.Fatal("a quota below the minimum was accepted")
	}
	s, err := Open(dir, Options{SizeMB: 32})
	if err != nil {
		t.Fatal(err)
	}
	v, err := s.Create("alice", "q")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = unix.Unmount(s.fsDir(v.ID), unix.MNT_DETACH) })
	if v.SizeMB != 32 {
		t.Fatalf("record %+v", v)
	}
	data := s.Dir(v.ID)
	if mounted, err := isMountPoint(filepath.Dir(data)); err != nil || !mounted {
		t.Fatalf("volume filesystem not mounted: %v %v", mounted, err)
	}
	ents, _ := os.ReadDir(data)
	if len(ents) != 0 {
		t.Fatalf("a new volume holds %v (lost+found must stay outside)", ents)
	}
	// A writer in the volume stops at the quota; the content API reports it as such.
	big := bytes.Repeat([]byte{1}, 40<<20)
	if err := os.WriteFile(filepath.Join(data, "big"), big, 0o644); !errors.Is(err, unix.ENOSPC) {
		t.Fatalf("40 MB into a 32 MB volume: %v", err)
	}
	_ = os.Remove(filepath.Join(data, "big"))
	c, err := s.Open(v.ID)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.WriteFile("/big", bytes.NewReader(big), Owner{}); !errors.Is(err, ErrNoSpace) {
		t.Fatalf("content API over the quota: %v", err)
	}
	if _, err := c.WriteFile("/small", bytes.NewReader([]byte("kept")), Owner{}); err != nil {
		t.Fatalf("after a refused write: %v", err)
	}
	c.Close()

	// A node restart finds the filesystem mounted and keeps that mount (sandboxes may
	// hold it); after a host reboot (unmounted) it mounts it again.
	if _, err := Open(dir, Options{}); err != nil {
		t.Fatal(err)
	}
	if err := unix.Unmount(s.fsDir(v.ID), 0); err != nil {
		t.Fatal(err)
	}
	s2, err := Open(dir, Options{})
	if err != nil {
		t.Fatal(err)
	}
	if b, err := os.ReadFile(filepath.Join(s2.Dir(v.ID), "small")); err != nil || string(b) != "kept" {
		t.Fatalf("after remount: %q %v", b, err)
	}
	// A volume made without the setting keeps its quota; new ones have none.
	w, err := s2.Create("alice", "plain")
	if err != nil || w.SizeMB != 0 {
		t.Fatalf("%+v %v", w, err)
	}
	if err := s2.Delete("alice", v.ID); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(dir, v.ID)); !os.IsNotExist(err) {
		t.Fatalf("deleted volume left %v", err)
	}
	if mounts, _ := os.ReadFile("/proc/self/mountinfo"); bytes.Contains(mounts, []byte(v.ID)) {
		t.Fatal("deleted volume still mounted")
	}
}

// BenchmarkCreateQuota measures making a volume with a quota (sparse image, mkfs.ext4,
// loop mount) against a plain directory.
func BenchmarkCreateQuota(b *testing.B) {
	for _, size := range []int{0, 1024, 10240} {
		b.Run(map[int]string{0: "directory", 1024: "1GiB", 10240: "10GiB"}[size], func(b *testing.B) {
			if size > 0 && os.Geteuid() != 0 {
				b.Skip("needs root")
			}
			s, err := Open(b.TempDir(), Options{SizeMB: size, MaxPerOwner: b.N + 1})
			if err != nil {
				b.Fatal(err)
			}
			var ids []string
			b.Cleanup(func() {
				for _, id := range ids {
					_ = s.Delete("o", id)
				}
			})
			for i := range b.N {
				v, err := s.Create("o", "v"+string(rune('a'+i%26))+string(rune('a'+i/26%26))+string(rune('a'+i/676%26)))
				if err != nil {
					b.Fatal(err)
				}
				ids = append(ids, v.ID)
			}
		})
	}
}
