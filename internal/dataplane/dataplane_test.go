package dataplane

import (
	"bufio"
	"bytes"
	"context"
	"crypto/rand"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/aenv-dev/aenv/internal/storage/lsmt"
	"github.com/aenv-dev/aenv/internal/storage/stack"
)

func needFUSE(t *testing.T) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root (FUSE mounts)")
	}
	if _, err := os.Stat("/dev/fuse"); err != nil {
		t.Skip("needs /dev/fuse")
	}
}

// sealedLayer writes a 4 MiB sealed layer of random data and returns it with the data.
func sealedLayer(t *testing.T, dir string) (stack.LayerRef, []byte) {
	t.Helper()
	data := make([]byte, 4<<20)
	rand.Read(data)
	img := filepath.Join(dir, "base.img")
	if err := os.WriteFile(img, data, 0o600); err != nil {
		t.Fatal(err)
	}
	src, err := os.Open(img)
	if err != nil {
		t.Fatal(err)
	}
	defer src.Close()
	path := filepath.Join(dir, "base.commit")
	f, err := os.Create(path)
	if err != nil {
		t.Fatal(err)
	}
	info, err := lsmt.Import(f, src, lsmt.CommitOptions{})
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		t.Fatal(err)
	}
	return stack.LayerRef{Path: path, Size: info.Size, UUID: info.UUID}, data
}

// serve runs a Server on a socket in dir until the test ends.
func serve(t *testing.T, dir string) (*Server, *Client, <-chan struct{}) {
	t.Helper()
	sock := filepath.Join(dir, "dp.sock")
	ln, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	srv := NewServer("test-build", nil)
	srv.FUSEDir = FUSEDir(dir)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { _ = srv.Serve(ctx, ln); close(done) }()
	t.Cleanup(func() { cancel(); <-done; srv.Close() })
	return srv, NewClient(sock), done
}

// TestServeOverSocket drives a disk through the socket API: open, I/O through its FUSE
// file, a snapshot in steps, a snapshot whose client goes away after the seal (the data
// plane finishes it), refusals, close and shutdown.
func TestServeOverSocket(t *testing.T) {
	needFUSE(t)
	dir := t.TempDir()
	base, data := sealedLayer(t, dir)
	srv, c, done := serve(t, dir)
	ctx := context.Background()
	diskDir := filepath.Join(dir, "disk1")

	if _, err := c.Open(ctx, Spec{Dir: "relative", Lowers: []stack.LayerRef{base}}); err == nil {
		t.Fatal("a relative disk dir was accepted")
	}
	d, err := c.Open(ctx, Spec{Dir: diskDir, Lowers: []stack.LayerRef{base}})
	if err != nil {
		t.Fatal(err)
	}
	if filepath.Dir(d.Path()) != srv.FUSEDir || d.Size() != int64(len(data)) {
		t.Fatalf("disk at %s of %d bytes, want a file in %s of %d", d.Path(), d.Size(), srv.FUSEDir, len(data))
	}
	if _, err := c.Open(ctx, Spec{Dir: diskDir, Lowers: []stack.LayerRef{base}}); err == nil {
		t.Fatal("the same disk was opened twice")
	}
	f, err := os.OpenFile(d.Path(), os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if _, err := f.WriteAt([]byte("hello"), 4096); err != nil {
		t.Fatal(err)
	}
	if err := f.Sync(); err != nil {
		t.Fatal(err)
	}
	readBack := func(want []byte) {
		t.Helper()
		got := make([]byte, len(data))
		if _, err := f.ReadAt(got, 0); err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(got, want) {
			t.Fatal("the disk does not read back what was written")
		}
	}
	want := append([]byte(nil), data...)
	copy(want[4096:], "hello")
	readBack(want)

	// A snapshot in steps.
	s, err := d.BeginSnapshot(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Quiet(ctx); err != nil {
		t.Fatal(err)
	}
	out1 := filepath.Join(dir, "snap1.commit")
	if _, err := s.Seal(ctx, out1); err != nil {
		t.Fatal(err)
	}
	lowers, _, err := s.Finish(ctx)
	s.End()
	if err != nil || len(lowers) != 2 || lowers[1].Path != out1 {
		t.Fatalf("lowers after a snapshot: %+v, %v", lowers, err)
	}
	// A snapshot whose client dies after the seal: the data plane makes it durable.
	s, err = d.BeginSnapshot(ctx)
	if err != nil {
		t.Fatal(err)
	}
	out2 := filepath.Join(dir, "snap2.commit")
	if _, err := s.Seal(ctx, out2); err != nil {
		t.Fatal(err)
	}
	s.End()
	sealedIdx := filepath.Join(diskDir, upperIndex+".sealed")
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		if _, err := os.Stat(sealedIdx); errors.Is(err, os.ErrNotExist) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the abandoned snapshot was not finished")
		}
	}
	list, err := c.List(ctx)
	if err != nil || len(list) != 1 || len(list[0].Lowers) != 3 || list[0].Lowers[2].Path != out2 {
		t.Fatalf("list after the abandoned snapshot: %+v, %v", list, err)
	}
	readBack(want)

	// Refusals: a client of another major version, an unknown op, a shutdown with a disk.
	raw, err := net.Dial("unix", c.Socket)
	if err != nil {
		t.Fatal(err)
	}
	json.NewEncoder(raw).Encode(request{Op: opHello, Version: APIVersion + 1})
	line, _ := bufio.NewReader(raw).ReadBytes('\n')
	raw.Close()
	var resp response
	if json.Unmarshal(line, &resp); resp.Code != codeVersion || resp.Version != APIVersion {
		t.Fatalf("hello of another version answered %s", line)
	}
	if _, err := c.do(ctx, request{Op: "frobnicate"}); !errors.Is(err, ErrUnsupported) {
		t.Fatalf("unknown op: %v", err)
	}
	if err := c.Shutdown(ctx); err == nil || !strings.Contains(err.Error(), "still served") {
		t.Fatalf("shutdown with a disk open: %v", err)
	}
	st, err := c.Stats(ctx)
	if err != nil || st.Disks != 1 || st.RSSBytes == 0 || st.Build != "test-build" {
		t.Fatalf("stats %+v, %v", st, err)
	}

	f.Close()
	if err := d.Close(); err != nil {
		t.Fatal(err)
	}
	if err := c.Close(ctx, diskDir); !errors.Is(err, ErrNotFound) {
		t.Fatalf("second close: %v", err)
	}
	if _, err := os.Stat(d.Path()); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("the disk's file is left after close: %v", err)
	}
	if srv.NumDisks() != 0 {
		t.Fatal("the server still counts a disk")
	}
	if err := c.Shutdown(ctx); err != nil {
		t.Fatal(err)
	}
	// Whoever saw the shutdown granted may remove the directory at once.
	if raw, _ := os.ReadFile("/proc/self/mountinfo"); strings.Contains(string(raw), " "+srv.FUSEDir+" ") {
		t.Fatal("the shared FUSE mount is still mounted after a granted shutdown")
	}
	select {
	case <-done:
	case <-time.After(5 * time.Second):
		t.Fatal("the server did not stop after a granted shutdown")
	}
}

// TestRunOnePerDir checks that a second daemon on the same directory steps aside and
// that the socket answers while the first runs.
func TestRunOnePerDir(t *testing.T) {
	dir := t.TempDir()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- Run(ctx, dir, "a", nil) }()
	c := NewClient(SocketPath(dir))
	for deadline := time.Now().Add(5 * time.Second); c.Ping(ctx) != nil; time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("the data plane does not answer")
		}
	}
	if err := Run(context.Background(), dir, "b", nil); !errors.Is(err, ErrRunning) {
		t.Fatalf("a second data plane on the same dir: %v", err)
	}
	if c.Build() != "a" {
		t.Fatalf("build %q answered", c.Build())
	}
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(SocketPath(dir)); !errors.Is(err, os.ErrNotExist) {
		t.Fatal("the socket is left after the data plane stopped")
	}
}

// TestDropSyncsOverSocket: after DropSyncs a disk keeps serving reads and writes but its
// flushes leave the upper unsynced; without it a flush syncs. A disk the data plane does
// not serve is no error (it syncs nothing anyway).
func TestDropSyncsOverSocket(t *testing.T) {
	needFUSE(t)
	dir := t.TempDir()
	base, _ := sealedLayer(t, dir)
	srv, c, _ := serve(t, dir)
	ctx := context.Background()
	for i, drop := range []bool{false, true} {
		diskDir := filepath.Join(dir, fmt.Sprintf("disk%d", i))
		d, err := c.Open(ctx, Spec{Dir: diskDir, Lowers: []stack.LayerRef{base}})
		if err != nil {
			t.Fatal(err)
		}
		if drop {
			if err := d.DropSyncs(); err != nil {
				t.Fatal(err)
			}
		}
		f, err := os.OpenFile(d.Path(), os.O_RDWR, 0)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := f.WriteAt([]byte("hello"), 4096); err != nil {
			t.Fatal(err)
		}
		if err := f.Sync(); err != nil {
			t.Fatal(err)
		}
		got := make([]byte, 5)
		if _, err := f.ReadAt(got, 4096); err != nil || string(got) != "hello" {
			t.Fatalf("drop %v: read back %q, %v", drop, got, err)
		}
		if synced := srv.get(diskDir).st.Synced(); synced == drop {
			t.Fatalf("drop %v: upper synced %v after a flush", drop, synced)
		}
		f.Close()
		if err := d.Close(); err != nil {
			t.Fatal(err)
		}
		if err := d.DropSyncs(); err != nil {
			t.Fatalf("DropSyncs of a closed disk: %v", err)
		}
	}
}
