package oci

import (
	"context"
	"fmt"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/aenv-dev/aenv/internal/sandbox"
	"github.com/aenv-dev/aenv/internal/storage/blockdev"
	"github.com/aenv-dev/aenv/internal/storage/stack"
)

// writeLoop writes 1 MiB files of a known pattern in the sandbox as fast as it can, and
// logs each file's number once it is complete, until /root/stop exists.
const writeLoop = `mkdir -p /root/w; i=0
while [ ! -e /root/stop ]; do
  yes $i | head -c 1048576 > /root/w/f$i && echo $i >> /root/w/log
  i=$((i+1))
done`

// checkLoop prints BAD for every logged file whose content is not the pattern, then
// the number of logged files.
const checkLoop = `for i in $(cat /root/w/log); do
  yes $i | head -c 1048576 | cmp -s - /root/w/f$i || echo BAD $i
done; wc -l < /root/w/log`

// TestBlockSnapshotUnderWrites snapshots (freeze, the default) a sandbox during a heavy
// write loop: the sealed image is a clean ext4 filesystem as it is (fsck-clean, no
// journal to replay), and a child launched from it has every file the loop had logged,
// each complete (the log line follows its file, so a freeze that kept the line kept the
// file); the source keeps writing afterwards.
func TestBlockSnapshotUnderWrites(t *testing.T) {
	for _, tool := range []string{"fsck.ext4", "dumpe2fs"} {
		if _, err := exec.LookPath(tool); err != nil {
			t.Skipf("needs %s (e2fsprogs)", tool)
		}
	}
	e := newTestBackend(t, nil)
	fs := testLayered(t)
	ctx := context.Background()
	a := e.launchBlock(t, "wl-a", fs, sandbox.Resources{CPUCount: 1, MemoryMB: 256, DiskSizeMB: 1024})
	loop := make(chan string, 1)
	go func() {
		out, code := e.sh(t, a, writeLoop)
		loop <- fmt.Sprintf("exit %d: %s", code, out)
	}()
	deadline := time.Now().Add(30 * time.Second)
	for {
		out, _ := e.sh(t, a, "wc -l < /root/w/log 2>/dev/null || echo 0")
		var n int
		fmt.Sscan(out, &n)
		if n >= 40 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("write loop logged %d files in 30 s", n)
		}
		time.Sleep(20 * time.Millisecond)
	}
	c, err := a.Snapshot(ctx)
	if err != nil {
		t.Fatal(err)
	}
	capd := c.(*Captured)
	t.Logf("snapshot under writes: frozen %dµs, total %dµs", capd.FrozenMicros, capd.TotalMicros)
	time.Sleep(100 * time.Millisecond) // the source keeps writing on its fresh upper
	e.mustSh(t, a, "touch /root/stop")
	select {
	case r := <-loop:
		if !strings.HasPrefix(r, "exit 0:") {
			t.Fatalf("write loop: %s", r)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("write loop did not stop")
	}
	srcOut := e.mustSh(t, a, checkLoop)

	// The sealed image as it is, read-only.
	st, err := stack.Open(ctx, &stack.Manifest{Dir: t.TempDir(), Lowers: capd.Layers}, stack.Options{})
	if err != nil {
		t.Fatal(err)
	}
	ex, err := blockdev.Expose(ctx, filepath.Join(t.TempDir(), "fsck"), st, blockdev.MountOptions{ReadOnly: true})
	if err != nil {
		st.Close()
		t.Fatal(err)
	}
	fout, ferr := exec.Command("fsck.ext4", "-n", "-f", ex.Device()).CombinedOutput()
	sb, derr := exec.Command("dumpe2fs", "-h", ex.Device()).CombinedOutput()
	if err := ex.Close(); err != nil {
		t.Error(err)
	}
	st.Close()
	if ferr != nil {
		t.Fatalf("fsck of the snapshot: %v\n%s", ferr, fout)
	}
	if derr != nil || strings.Contains(string(sb), "needs_recovery") {
		t.Fatalf("snapshot superblock (%v): journal not flushed:\n%s", derr, sb)
	}

	k := e.launchPlan(t, sandbox.LaunchPlan{Kind: sandbox.LaunchFromSnapshot, SandboxID: "wl-k", Snapshot: c,
		Resources: sandbox.Resources{CPUCount: 1, MemoryMB: 128}})
	out := e.mustSh(t, k, checkLoop)
	if strings.Contains(out, "BAD") {
		t.Fatalf("child has incomplete files: %s", out)
	}
	var kn, sn int
	fmt.Sscan(out, &kn)
	fmt.Sscan(srcOut, &sn)
	if kn < 40 || kn > sn || strings.Contains(srcOut, "BAD") {
		t.Fatalf("child has %d logged files, source %d (%q)", kn, sn, srcOut)
	}
	t.Logf("%d files in the snapshot, %d in the source at the end", kn, sn)
	for _, i := range []*Instance{k, a} {
		if err := i.Stop(ctx); err != nil {
			t.Fatal(err)
		}
	}
	if err := e.b.DiscardSnapshot(ctx, c); err != nil {
		t.Fatal(err)
	}
}
