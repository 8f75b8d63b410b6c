package oci

import (
	"errors"
	"fmt"
	"log/slog"
	"runtime"
	"sync"

	"golang.org/x/sys/unix"
)

// nsThreadsMax is how many threads nsThreads keeps: a fork's children reroot at once, and
// each reroot holds its thread for well under a millisecond.
const nsThreadsMax = 4

// nsThreads runs functions that join another mount namespace (joinMountNS) on OS threads
// that come back to the node's namespace, root and working directory afterwards and are
// kept for the next one. A thread thrown away after every function (onDiscardedThread)
// made Go end it and start another for the next: ~0.5 ms of the node's CPU per fork child
// (clone, the thread's stack, its exit), a fork of 16 reroots 16 blank containers. A
// thread here only ever runs these functions (it is locked and never unlocked), has its
// own root and working directory (unshare(CLONE_FS), which setns into a mount namespace
// needs) and no other state they change; one that cannot come back is thrown away.
type nsThreads struct {
	jobs chan nsJob
	quit chan struct{}
	// home, root and cwd are the node's mount namespace, root and working directory.
	home, root, cwd int
	log             *slog.Logger

	mu      sync.Mutex
	threads int
	busy    int // threads running a job or on their way back from one
	closed  bool
	wg      sync.WaitGroup
}

type nsJob struct {
	fn   func() error
	done chan error
}

// errNSThreadsClosed means the backend is closing.
var errNSThreadsClosed = errors.New("oci: namespace threads closed")

// newNSThreads opens what its threads come back to: the main thread's mount namespace
// (the node's; see mntns.go's init), the root and the working directory.
func newNSThreads(log *slog.Logger) (*nsThreads, error) {
	t := &nsThreads{jobs: make(chan nsJob), quit: make(chan struct{}), home: -1, root: -1, cwd: -1, log: log}
	var err error
	for _, f := range []struct {
		fd    *int
		path  string
		flags int
	}{
		{&t.home, "/proc/self/ns/mnt", unix.O_RDONLY},
		{&t.root, "/", unix.O_PATH | unix.O_DIRECTORY},
		{&t.cwd, ".", unix.O_PATH | unix.O_DIRECTORY},
	} {
		if *f.fd, err = unix.Open(f.path, f.flags|unix.O_CLOEXEC, 0); err != nil {
			t.closeFDs()
			return nil, fmt.Errorf("oci: namespace threads: open %s: %w", f.path, err)
		}
	}
	return t, nil
}

// run runs fn on one of the threads, starting one when all are busy and fewer than
// nsThreadsMax exist, and returns fn's error. fn runs in the node's namespace and may
// join another with joinMountNS; it must change nothing else of its thread's.
func (t *nsThreads) run(fn func() error) error {
	job := nsJob{fn: fn, done: make(chan error, 1)}
	select {
	case t.jobs <- job: // an idle thread took it
		return <-job.done
	default:
	}
	t.mu.Lock()
	switch {
	case t.closed:
		t.mu.Unlock()
		return errNSThreadsClosed
	case t.threads == t.busy && t.threads < nsThreadsMax:
		t.threads++
		t.busy++
		t.wg.Add(1)
		t.mu.Unlock()
		go t.thread(job)
	default: // a thread is about to wait for a job, or all are busy and no more may start
		t.mu.Unlock()
		select {
		case t.jobs <- job:
		case <-t.quit:
			return errNSThreadsClosed
		}
	}
	return <-job.done
}

// thread serves jobs on a locked OS thread until close, or until it cannot come back
// from a job's namespace; Go ends the thread then (it stays locked).
func (t *nsThreads) thread(job nsJob) {
	runtime.LockOSThread()
	busy := true
	defer func() {
		t.mu.Lock()
		t.threads--
		if busy {
			t.busy--
		}
		t.mu.Unlock()
		t.wg.Done()
	}()
	if unix.Gettid() == unix.Getpid() {
		runtime.UnlockOSThread()
		job.done <- errMainThread
		return
	}
	if err := unix.Unshare(unix.CLONE_FS); err != nil {
		job.done <- fmt.Errorf("oci: unshare fs: %w", err)
		return
	}
	for {
		err := job.fn()
		if back := t.comeBack(); back != nil {
			job.done <- err
			t.log.Warn("oci: a namespace thread could not come back; it is thrown away", "err", back)
			return
		}
		t.setBusy(&busy, false) // before the answer, so that the next run waits for this thread
		job.done <- err
		select {
		case job = <-t.jobs:
			t.setBusy(&busy, true)
		case <-t.quit:
			return
		}
	}
}

func (t *nsThreads) setBusy(busy *bool, b bool) {
	t.mu.Lock()
	if b {
		t.busy++
	} else {
		t.busy--
	}
	*busy = b
	t.mu.Unlock()
}

// comeBack puts the calling thread back in the node's mount namespace, root and working
// directory (setns into a mount namespace moves both to the namespace's root).
func (t *nsThreads) comeBack() error {
	if err := unix.Setns(t.home, unix.CLONE_NEWNS); err != nil {
		return fmt.Errorf("join the node's mount namespace: %w", err)
	}
	if err := unix.Fchdir(t.root); err != nil {
		return fmt.Errorf("the node's root: %w", err)
	}
	if err := unix.Chroot("."); err != nil {
		return fmt.Errorf("the node's root: %w", err)
	}
	if err := unix.Fchdir(t.cwd); err != nil {
		return fmt.Errorf("the node's working directory: %w", err)
	}
	return nil
}

// close ends the threads once their jobs are done and closes the descriptors; run fails
// afterwards.
func (t *nsThreads) close() {
	t.mu.Lock()
	if t.closed {
		t.mu.Unlock()
		return
	}
	t.closed = true
	close(t.quit)
	t.mu.Unlock()
	t.wg.Wait()
	t.closeFDs()
}

func (t *nsThreads) closeFDs() {
	for _, fd := range []*int{&t.home, &t.root, &t.cwd} {
		if *fd >= 0 {
			unix.Close(*fd)
			*fd = -1
		}
	}
}
