// Package reaper owns the waiting for child processes. envd runs as PID 1 in containers, where it
// must also reap orphans that re-parent to it: one loop collects every exit with wait4(-1) and hands
// each status to whoever started that child, so a process's exit status is never stolen.
package reaper

import (
	"errors"
	"os"
	"sync"
	"sync/atomic"

	"golang.org/x/sys/unix"
)

// Waiter starts children and waits for their exit.
type Waiter interface {
	// Start calls fork, which must start exactly one child and return its pid, and returns a
	// function that blocks until that child has exited and been reaped.
	Start(fork func() (int, error)) (pid int, wait func() unix.WaitStatus, err error)
}

// Direct waits for each child with wait4(pid). It is right for an ordinary process (and for tests),
// where other code in the same process may have children of its own.
type Direct struct{}

// Start implements Waiter.
func (Direct) Start(fork func() (int, error)) (int, func() unix.WaitStatus, error) {
	pid, err := fork()
	if err != nil {
		return 0, nil, err
	}
	return pid, func() unix.WaitStatus {
		var ws unix.WaitStatus
		for {
			_, err := unix.Wait4(pid, &ws, 0, nil)
			if errors.Is(err, unix.EINTR) {
				continue
			}
			if err != nil { // somebody else reaped it; report an unknown failure
				return unix.WaitStatus(255 << 8)
			}
			return ws
		}
	}, nil
}

// Reaper collects every child's exit with wait4(-1), so that it also reaps the orphans the
// kernel re-parents to this process. Use it in PID 1 or a subreaper, and start every child
// through it.
//
// Its loop blocks in wait4 while the process has children and parks once it has none, until
// Start forks the next: it takes no signal (os/signal keeps two threads blocked in every
// process that uses it, and the runtime a third, in each of the thousands of idle envds a
// node holds) and holds no thread while there is nothing to wait for. No orphan is missed by
// parking: a process's children are re-parented before its own exit is reported, so a
// descendant can only become this process's child while another child is alive. (A process
// that entered PID 1's namespace from outside, whose parent outside then dies, is the
// exception: it is reaped with the next Start's exits.)
type Reaper struct {
	mu      sync.Mutex
	waiting map[int]chan unix.WaitStatus
	orphans atomic.Int64
	forked  chan struct{} // a child was started: wait4 has something to wait for
	done    chan struct{}
}

// New starts the reaping loop. When subreaper is true and envd is not PID 1 it asks the kernel to
// re-parent orphaned descendants to this process (PR_SET_CHILD_SUBREAPER).
func New(subreaper bool) (*Reaper, error) {
	if subreaper && os.Getpid() != 1 {
		if err := unix.Prctl(unix.PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0); err != nil {
			return nil, err
		}
	}
	r := &Reaper{waiting: map[int]chan unix.WaitStatus{}, forked: make(chan struct{}, 1), done: make(chan struct{})}
	go r.loop()
	return r, nil
}

// Stop ends the loop once the process has no child left (tests).
func (r *Reaper) Stop() { close(r.done) }

// Orphans is how many exits were reaped that no caller waited for.
func (r *Reaper) Orphans() int64 { return r.orphans.Load() }

// Start implements Waiter. fork runs under the reaper's lock so that an exit reaped right after the
// fork still finds its waiter.
func (r *Reaper) Start(fork func() (int, error)) (int, func() unix.WaitStatus, error) {
	r.mu.Lock()
	pid, err := fork()
	if err != nil {
		r.mu.Unlock()
		return 0, nil, err
	}
	ch := make(chan unix.WaitStatus, 1)
	r.waiting[pid] = ch
	r.mu.Unlock()
	select {
	case r.forked <- struct{}{}:
	default: // the loop is already told
	}
	return pid, func() unix.WaitStatus { return <-ch }, nil
}

func (r *Reaper) loop() {
	for {
		r.reapAll() // children that exited before the loop started, and each wake's
		select {
		case <-r.forked:
		case <-r.done:
			return
		}
	}
}

// reapAll waits for exits until the process has no child.
func (r *Reaper) reapAll() {
	for {
		var ws unix.WaitStatus
		pid, err := unix.Wait4(-1, &ws, 0, nil)
		if errors.Is(err, unix.EINTR) {
			continue
		}
		if err != nil || pid <= 0 {
			return // ECHILD
		}
		r.mu.Lock()
		ch := r.waiting[pid]
		delete(r.waiting, pid)
		r.mu.Unlock()
		if ch != nil {
			ch <- ws
		} else {
			r.orphans.Add(1)
		}
	}
}
