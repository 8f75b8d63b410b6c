package dataplane

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/aenv-dev/aenv/internal/storage/blockdev"
	"github.com/aenv-dev/aenv/internal/storage/stack"
)

// TestSharedLayers: disks on the same lower open it once (Stats.Layers), each keeps its
// own writes, a snapshot of one adds its layer, and the layer closes when the last disk
// using it does, including a disk whose close had to wait for its last user.
func TestSharedLayers(t *testing.T) {
	needFUSE(t)
	dir := t.TempDir()
	base, data := sealedLayer(t, dir)
	_, c, _ := serve(t, dir)
	ctx := context.Background()
	layers := func(want int) {
		t.Helper()
		st, err := c.Stats(ctx)
		if err != nil || st.Layers != want {
			t.Fatalf("stats %+v, %v; want %d layers", st, err, want)
		}
	}
	var mu sync.Mutex
	disks := map[int]*RemoteDisk{}
	var wg sync.WaitGroup
	errs := make(chan error, 4)
	for i := range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			d, err := c.Open(ctx, Spec{Dir: filepath.Join(dir, fmt.Sprintf("disk%d", i)), Lowers: []stack.LayerRef{base}})
			if err != nil {
				errs <- err
				return
			}
			mu.Lock()
			disks[i] = d
			mu.Unlock()
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	layers(1)
	files := map[int]*os.File{}
	for i, d := range disks {
		f, err := os.OpenFile(d.Path(), os.O_RDWR, 0)
		if err != nil {
			t.Fatal(err)
		}
		defer f.Close()
		files[i] = f
		if _, err := f.WriteAt([]byte(fmt.Sprintf("disk %d", i)), 8192); err != nil {
			t.Fatal(err)
		}
		if err := f.Sync(); err != nil {
			t.Fatal(err)
		}
	}
	for i, f := range files {
		got := make([]byte, len(data))
		if _, err := f.ReadAt(got, 0); err != nil {
			t.Fatal(err)
		}
		want := append([]byte(nil), data...)
		copy(want[8192:], fmt.Sprintf("disk %d", i))
		if !bytes.Equal(got, want) {
			t.Fatalf("disk %d does not read its own data over the shared layer", i)
		}
	}

	s, err := disks[0].BeginSnapshot(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := s.Seal(ctx, filepath.Join(dir, "snap.commit")); err != nil {
		t.Fatal(err)
	}
	if _, _, err := s.Finish(ctx); err != nil {
		t.Fatal(err)
	}
	s.End()
	layers(2)
	files[0].Close()
	if err := disks[0].Close(); err != nil {
		t.Fatal(err)
	}
	layers(1)
	for _, i := range []int{1, 2} {
		files[i].Close()
		if err := disks[i].Close(); err != nil {
			t.Fatal(err)
		}
	}
	layers(1)
	// Disk 3's file is still open: its close waits, then leaves it served until released.
	if err := disks[3].Close(); !errors.Is(err, blockdev.ErrStillInUse) {
		t.Fatalf("close of a disk still in use: %v", err)
	}
	layers(1)
	files[3].Close()
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		st, err := c.Stats(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if st.Layers == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the shared layer stayed open after its last disk was released")
		}
	}
}
