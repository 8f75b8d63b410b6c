package oci

import (
	"context"
	"errors"
	"fmt"
	"runtime"
	"time"

	"golang.org/x/sys/unix"
)

// teardownNice is the nice value of a background teardown's thread.
const teardownNice = 10

// StopAfterCapture stops a sandbox whose state is already captured (a pause to disk): its
// processes are killed before it returns, and the rest of Stop (runtime state, cgroups,
// root filesystem, network slot, bundle) goes on in the background, so the pause answers
// without waiting for the teardown. The sandbox id is free again at once: a relaunch
// under it (the resume) uses a container id of its own until the teardown is done.
// Backend.Close waits for teardowns in flight; a crash leaves them to Reconcile.
//
// When the processes cannot be confirmed dead, it falls back to a synchronous Stop.
func (i *Instance) StopAfterCapture(ctx context.Context) error {
	if err := i.live(); err != nil {
		return nil // stopped already: nothing runs
	}
	i.mu.Lock()
	cid, l, m := i.cid, i.l, i.idmap
	i.mu.Unlock()
	err := killInit(l.pid(), i.b.cgroupsPath(cid), i.b.v2, i.b.usernsFDs.keeper(m))
	if err != nil && !errors.Is(err, errNoInit) {
		i.b.log.Warn("oci: kill for a background teardown failed; stopping in the foreground", "id", i.id, "err", err)
		return i.Stop(ctx)
	}
	b := i.b
	b.mu.Lock()
	if b.instances[i.id] == i {
		delete(b.instances, i.id)
	}
	b.tearing[i.id]++
	b.teardowns.Add(1)
	b.mu.Unlock()
	go func() {
		defer b.teardowns.Done()
		// The teardown's own syscalls (unmounts, loop and network deletion) yield to the
		// launches it usually overlaps with (the resume of this very sandbox): the thread
		// runs niced, and ends with this goroutine (Go discards a thread left locked).
		runtime.LockOSThread()
		_ = unix.Setpriority(unix.PRIO_PROCESS, 0, teardownNice)
		start := time.Now()
		ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Minute)
		defer cancel()
		if err := i.Stop(ctx); err != nil {
			b.log.Warn("oci: background teardown", "id", i.id, "cid", cid, "err", err)
		}
		b.mu.Lock()
		if b.tearing[i.id]--; b.tearing[i.id] <= 0 {
			delete(b.tearing, i.id)
		}
		b.mu.Unlock()
		b.log.Debug("oci: background teardown done", "id", i.id, "cid", cid, "took", time.Since(start))
	}()
	return nil
}

// containerID picks the runtime container id (and bundle name) for a new container of
// sandbox id: the id itself, unless an earlier container of it is still being torn down,
// then the id with a suffix ('.' never occurs in sandbox ids, so it cannot collide).
func (b *Backend) containerID(id string) string {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.tearing[id] == 0 {
		return id
	}
	b.seq++
	return fmt.Sprintf("%s.%d", id, b.seq)
}

// waitTeardowns waits for background teardowns until ctx ends.
func (b *Backend) waitTeardowns(ctx context.Context) error {
	done := make(chan struct{})
	go func() {
		b.teardowns.Wait()
		close(done)
	}()
	select {
	case <-done:
		return nil
	case <-ctx.Done():
		return fmt.Errorf("oci: background teardowns still running: %w", ctx.Err())
	}
}
