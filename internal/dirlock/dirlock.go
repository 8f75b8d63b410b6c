// Package dirlock serializes work on a directory across processes with an flock on a
// ".lock" file inside it, waiting for the holder as long as the context allows.
package dirlock

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"time"

	"golang.org/x/sys/unix"
)

// pollInterval is how often a waiter retries; flock has no context-aware blocking form.
const pollInterval = 50 * time.Millisecond

// Acquire locks dir and returns the function that unlocks it. The lock is released by
// the kernel if the process dies, so a crash never leaves it held.
func Acquire(ctx context.Context, dir string) (unlock func(), err error) {
	f, err := os.OpenFile(filepath.Join(dir, ".lock"), os.O_CREATE|os.O_RDWR, 0o644)
	if err != nil {
		return nil, fmt.Errorf("lock %s: %w", dir, err)
	}
	for {
		err := unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB)
		if err == nil {
			return func() { unix.Flock(int(f.Fd()), unix.LOCK_UN); f.Close() }, nil
		}
		if !errors.Is(err, unix.EWOULDBLOCK) {
			f.Close()
			return nil, fmt.Errorf("lock %s: %w", dir, err)
		}
		select {
		case <-ctx.Done():
			f.Close()
			return nil, fmt.Errorf("lock %s: %w", dir, ctx.Err())
		case <-time.After(pollInterval):
		}
	}
}
