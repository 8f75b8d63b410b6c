package dirlock

import (
	"context"
	"errors"
	"testing"
	"time"
)

func TestAcquireWaitsForHolder(t *testing.T) {
	dir := t.TempDir()
	unlock, err := Acquire(context.Background(), dir)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
	defer cancel()
	if _, err := Acquire(ctx, dir); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("second Acquire while held = %v, want the context's deadline", err)
	}
	unlock()
	unlock2, err := Acquire(context.Background(), dir)
	if err != nil {
		t.Fatalf("Acquire after unlock: %v", err)
	}
	unlock2()
}

func TestAcquireMissingDir(t *testing.T) {
	if _, err := Acquire(context.Background(), "/nonexistent/dirlock"); err == nil {
		t.Fatal("Acquire of a missing directory succeeded")
	}
}
