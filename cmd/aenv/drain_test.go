package main

import (
	"os"
	"path/filepath"
	"testing"
)

func TestDrainedKeptInDataDir(t *testing.T) {
	dir := t.TempDir()
	for i, step := range []struct {
		draining bool
		want     bool
	}{
		{false, false}, // undrain a node that never drained
		{true, true},
		{true, true}, // drain twice
		{false, false},
		{false, false},
	} {
		if err := saveDrained(dir, step.draining); err != nil {
			t.Fatalf("step %d: save %t: %v", i, step.draining, err)
		}
		got, err := loadDrained(dir)
		if err != nil || got != step.want {
			t.Fatalf("step %d: load = %t, %v; want %t", i, got, err, step.want)
		}
	}
}

func TestDrainedUnwritableDataDir(t *testing.T) {
	// A data dir that is a file: the drain cannot be kept, and says so.
	dir := filepath.Join(t.TempDir(), "file")
	if err := os.WriteFile(dir, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := saveDrained(dir, true); err == nil {
		t.Fatal("saveDrained in a data dir that is a file succeeded")
	}
	if _, err := loadDrained(dir); err == nil {
		t.Fatal("loadDrained in a data dir that is a file succeeded")
	}
}
