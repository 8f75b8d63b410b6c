package vmm_test

import (
	"context"
	"fmt"
	"path/filepath"
	"slices"
	"testing"
	"time"

	"github.com/aenv-dev/aenv/internal/vmm"
)

func reportMedian(b *testing.B, name string, ds []time.Duration) {
	if len(ds) == 0 {
		return
	}
	slices.Sort(ds)
	b.ReportMetric(float64(ds[len(ds)/2].Microseconds())/1000, name)
}

// template boots the test guest on a shared RAM file and takes a device-state snapshot.
func template(b *testing.B) (guest, string, vmm.State, int) {
	g := newGuest(b)
	dir, shm := b.TempDir(), shmDir(b)
	ram := filepath.Join(shm, "template.ram")
	src := start(b, g.config(b, dir, "src", ram, true))
	waitCounts(b, src, 3, 60*time.Second)
	get(b, hostPort(src.Config()), "/count", 10*time.Second)
	st, err := src.SaveDeviceState(context.Background(), filepath.Join(dir, "template.state"))
	if err != nil {
		b.Fatal(err)
	}
	src.Kill()
	if err := vmm.MarkTemplate(ram); err != nil {
		b.Fatal(err)
	}
	return g, ram, st, 0
}

// BenchmarkRestoreCoW restores a fork on a private mapping of the template's RAM file:
// restore-ms is spawn → running (QMP cont answered), answer-ms is spawn → first HTTP 200
// from the guest through the host forward.
func BenchmarkRestoreCoW(b *testing.B) {
	g, ram, st, _ := template(b)
	dir := b.TempDir()
	var restore, answer []time.Duration
	i := 0
	for b.Loop() {
		cfg := g.config(b, dir, fmt.Sprintf("fork%d", i), ram, false)
		i++
		t0 := time.Now()
		m, err := vmm.Restore(context.Background(), cfg, st)
		if err != nil {
			b.Fatal(err)
		}
		restore = append(restore, time.Since(t0))
		get(b, hostPort(cfg), "/count", 20*time.Second)
		answer = append(answer, time.Since(t0))
		m.Kill()
	}
	reportMedian(b, "restore-ms", restore)
	reportMedian(b, "answer-ms", answer)
}

// BenchmarkSaveDeviceState snapshots a running shared-RAM guest (stop + device state)
// and resumes it.
func BenchmarkSaveDeviceState(b *testing.B) {
	g := newGuest(b)
	dir, shm := b.TempDir(), shmDir(b)
	m := start(b, g.config(b, dir, "src", filepath.Join(shm, "ram"), true))
	waitCounts(b, m, 3, 60*time.Second)
	ctx := context.Background()
	var save []time.Duration
	for b.Loop() {
		t0 := time.Now()
		if _, err := m.SaveDeviceState(ctx, filepath.Join(dir, "state")); err != nil {
			b.Fatal(err)
		}
		save = append(save, time.Since(t0))
		if err := m.Resume(ctx); err != nil {
			b.Fatal(err)
		}
	}
	reportMedian(b, "save-ms", save)
}

// BenchmarkSaveFull snapshots a running guest with its RAM in the stream.
func BenchmarkSaveFull(b *testing.B) {
	g := newGuest(b)
	dir, shm := b.TempDir(), shmDir(b)
	m := start(b, g.config(b, dir, "src", filepath.Join(shm, "ram"), false))
	waitCounts(b, m, 3, 60*time.Second)
	ctx := context.Background()
	var save []time.Duration
	var size int64
	for b.Loop() {
		t0 := time.Now()
		st, err := m.SaveFull(ctx, filepath.Join(dir, "state"))
		if err != nil {
			b.Fatal(err)
		}
		save = append(save, time.Since(t0))
		size = st.Size
		if err := m.Resume(ctx); err != nil {
			b.Fatal(err)
		}
	}
	reportMedian(b, "save-ms", save)
	b.ReportMetric(float64(size)/(1<<20), "state-MiB")
}
