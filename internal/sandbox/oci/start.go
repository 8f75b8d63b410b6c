package oci

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"time"

	"golang.org/x/sys/unix"
)

// errInitGone means a created container's init died before it was started.
var errInitGone = errors.New("oci: the container's init is gone")

// startRunc starts the created runc container whose state directory is dir, doing
// itself what `runc start` does (libcontainer's Container.Exec): the init, set up and
// blocked opening the write end of dir/exec.fifo, goes on to exec the container's
// process once the fifo is opened for reading and read. It writes one byte, and its
// end of the fifo is close-on-exec, so reading to the end returns once the process has
// been exec'd; removing the fifo then marks the container running (runc tells "created"
// from "running" by the fifo alone, as readRuncStates does). The `runc start` exec this
// replaces cost ~40 ms of CPU per sandbox on a busy 2-vCPU host (a Go binary's start,
// loading the container, parsing mountinfo) for one open and one read.
//
// Like runc, it watches the init while waiting: if the init dies first (or ctx ends),
// it opens the fifo's write end itself so the blocked reader returns, and fails.
func startRunc(ctx context.Context, dir, proc string) error {
	raw, err := os.ReadFile(filepath.Join(dir, "state.json"))
	if err != nil {
		return fmt.Errorf("oci: start: %w", err)
	}
	var st runcState
	if err := json.Unmarshal(raw, &st); err != nil || st.InitPid == nil || st.InitStart == nil {
		return fmt.Errorf("oci: start: runc state %s not understood", dir)
	}
	fifo := filepath.Join(dir, "exec.fifo")
	// Both ends are opened through a descriptor of the fifo itself, not its path: if the
	// state directory goes while the reader waits (a reconcile removing the container),
	// the blocked reader can still be released.
	pfd, err := unix.Open(fifo, unix.O_PATH|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("oci: start %s: not a created container: %w", st.ID, err)
	}
	defer unix.Close(pfd)
	ref := fmt.Sprintf("/proc/self/fd/%d", pfd)
	done := make(chan error, 1)
	go func() { done <- readExecFifo(ref) }()
	tick := time.NewTicker(100 * time.Millisecond)
	defer tick.Stop()
	for {
		select {
		case err := <-done:
			if err != nil {
				return fmt.Errorf("oci: start %s: %w", st.ID, err)
			}
			if err := os.Remove(fifo); err != nil {
				return fmt.Errorf("oci: start %s: %w", st.ID, err)
			}
			return nil
		case <-tick.C:
			if alive(proc, *st.InitPid, *st.InitStart) {
				continue
			}
			if err := releaseExecFifo(ref, done); err == nil {
				// It wrote its byte and exec'd, then exited: it was started.
				return os.Remove(fifo)
			}
			return fmt.Errorf("%w: %s", errInitGone, st.ID)
		case <-ctx.Done():
			_ = releaseExecFifo(ref, done)
			return fmt.Errorf("oci: start %s: %w", st.ID, ctx.Err())
		}
	}
}

// readExecFifo opens fifo for reading (blocking until a writer opens it) and reads it to
// the end; the init writes one byte, and no byte means no init was there.
func readExecFifo(fifo string) error {
	f, err := os.OpenFile(fifo, os.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return err
	}
	defer f.Close()
	data, err := io.ReadAll(f)
	if err != nil {
		return err
	}
	if len(data) == 0 {
		return errInitGone
	}
	return nil
}

// releaseExecFifo makes the reader (readExecFifo, answering on done) return when no init
// will open the fifo: it opens and closes the write end without blocking, so a reader
// blocked opening it goes on and sees the end of the file. Until the reader has the fifo
// open that fails (ENXIO), so it retries until the reader answers, and returns its answer.
func releaseExecFifo(fifo string, done <-chan error) error {
	for {
		fd, err := unix.Open(fifo, unix.O_WRONLY|unix.O_NONBLOCK|unix.O_CLOEXEC, 0)
		if err == nil {
			unix.Close(fd)
		} else if !errors.Is(err, unix.ENXIO) {
			return fmt.Errorf("oci: release %s: %w", fifo, err)
		}
		select {
		case err := <-done:
			return err
		case <-time.After(5 * time.Millisecond):
		}
	}
}

// startCrun starts the created crun container whose state directory is dir, doing itself
// what `crun start` does (libcrun_container_start without hooks or a notify socket, which
// sandboxes have not): crun's init, set up and waiting to read dir/exec.fifo, goes on to
// exec the container's process once a byte is written to it; the fifo is removed first,
// which marks the container running (crun tells "created" from "running" by the fifo
// alone). `crun start` cost a process start with ten shared libraries loaded, twice (crun
// re-executes itself), for one open and one write. The write end is opened without
// blocking: with no init holding the read end, the open fails (ENXIO) instead of waiting.
func startCrun(dir string) error {
	fifo := filepath.Join(dir, "exec.fifo")
	fd, err := unix.Open(fifo, unix.O_WRONLY|unix.O_NONBLOCK|unix.O_CLOEXEC, 0)
	switch {
	case errors.Is(err, unix.ENXIO):
		return fmt.Errorf("%w: %s", errInitGone, filepath.Base(dir))
	case err != nil:
		return fmt.Errorf("oci: start %s: not a created container: %w", filepath.Base(dir), err)
	}
	defer unix.Close(fd)
	if err := unix.Unlink(fifo); err != nil {
		return fmt.Errorf("oci: start %s: %w", filepath.Base(dir), err)
	}
	if _, err := unix.Write(fd, []byte{0}); err != nil {
		return fmt.Errorf("oci: start %s: %w", filepath.Base(dir), err)
	}
	return nil
}
