package microvm

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/aenv-dev/aenv/internal/sandbox"
)

// procStatus reads the fields of /proc/PID/status.
func procStatus(t *testing.T, pid int) map[string]string {
	t.Helper()
	raw, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]string{}
	for _, l := range strings.Split(string(raw), "\n") {
		if k, v, ok := strings.Cut(l, ":"); ok {
			out[k] = strings.TrimSpace(v)
		}
	}
	return out
}

// checkConfined checks that a VM's QEMU runs as the backend's QEMU user with no
// capability, under its seccomp filter, chrooted into the empty root, holding only the
// files it needs.
func checkConfined(t *testing.T, b *Backend, i *Instance) {
	t.Helper()
	pid := i.PID()
	st := procStatus(t, pid)
	uid, gid, _ := parseUser(b.cfg.QEMUUser)
	for k, want := range map[string]string{
		"Uid": fmt.Sprintf("%d\t%d\t%d\t%d", uid, uid, uid, uid), "Gid": fmt.Sprintf("%d\t%d\t%d\t%d", gid, gid, gid, gid),
		"CapPrm": "0000000000000000", "CapEff": "0000000000000000", "NoNewPrivs": "1", "Seccomp": "2",
	} {
		if st[k] != want {
			t.Errorf("%s: QEMU %d's %s is %q, want %q", i.id, pid, k, st[k], want)
		}
	}
	if root, err := os.Readlink(fmt.Sprintf("/proc/%d/root", pid)); err != nil || root != b.cfg.chrootDir() {
		t.Errorf("%s: QEMU %d's root is %q (%v), want %s", i.id, pid, root, err, b.cfg.chrootDir())
	}
	// Its descriptors: its own files, the memory image it restored from (a private
	// mapping), the tap, sockets, anonymous objects and /dev nodes QEMU opens for itself;
	// nothing else of the host.
	fds, err := filepath.Glob(fmt.Sprintf("/proc/%d/fd/*", pid))
	if err != nil {
		t.Fatal(err)
	}
	allowed := []string{i.dir + "/", b.cfg.RAMDir + "/", b.cfg.capturesDir() + "/", b.cfg.fetchedDir() + "/", "socket:", "anon_inode:", "pipe:", "/dev/null", "/dev/net/tun", "/dev/urandom"}
	for _, fd := range fds {
		target, err := os.Readlink(fd)
		if err != nil {
			continue
		}
		ok := false
		for _, a := range allowed {
			ok = ok || strings.HasPrefix(target, a)
		}
		if !ok {
			t.Errorf("%s: QEMU %d holds %s → %s", i.id, pid, filepath.Base(fd), target)
		}
	}
}

// TestConfinedQEMU: a confined QEMU (the default) boots, answers, is snapshotted, and a
// sandbox restored from the snapshot (a copy-on-write fork of its memory) runs the
// snapshot's processes, both QEMUs unprivileged: not root, no capabilities, seccomp,
// chrooted.
func TestConfinedQEMU(t *testing.T) {
	b := newTestBackend(t)
	if b.confine == nil {
		t.Fatal("the backend does not confine QEMU by default")
	}
	ctx := context.Background()
	src := launch(t, b, "conf-src", sandbox.Resources{})
	checkConfined(t, b, src)
	mustSh(t, src, `echo before > /tmp/mark; echo disk > /root/mark`)
	c, err := src.Snapshot(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer b.DiscardSnapshot(ctx, c)
	if got := mustSh(t, src, `cat /tmp/mark`); got != "before\n" {
		t.Errorf("source after the snapshot: %q", got)
	}
	inst, err := b.Launch(ctx, sandbox.LaunchPlan{Kind: sandbox.LaunchFromSnapshot, SandboxID: "conf-child", Snapshot: c, AllowInternet: true})
	if err != nil {
		t.Fatal(err)
	}
	child := inst.(*Instance)
	waitEnvd(t, child)
	checkConfined(t, b, child)
	if got := mustSh(t, child, `cat /tmp/mark /root/mark`); got != "before\ndisk\n" {
		t.Errorf("restored child: %q, want the snapshot's memory and disk", got)
	}
}

// TestConfinementRejects: a bad QEMU user fails New with a clear error.
func TestConfinementRejects(t *testing.T) {
	for _, u := range []string{"0:0", "root", "1000", "-1:5", "5:0", "a:b"} {
		if _, _, err := parseUser(u); err == nil {
			t.Errorf("QEMUUser %q accepted", u)
		}
	}
	if uid, gid, err := parseUser(DefaultQEMUUser); err != nil || uid == 0 || gid == 0 {
		t.Errorf("default %q: %d %d %v", DefaultQEMUUser, uid, gid, err)
	}
}
