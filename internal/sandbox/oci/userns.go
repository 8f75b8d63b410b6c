package oci

import (
	"errors"
	"fmt"
	"os"
	"strings"
	"sync"

	"golang.org/x/sys/unix"
)

// maxKeptUserns bounds the user namespaces kept for free slots: past it a stopped
// sandbox's namespace is let go, and a later create on its slot makes one again.
const maxKeptUserns = 1024

// usernsCache hands out user namespace fds per id mapping, for the id-mapped mounts of
// sandbox roots. Making one starts a child (usernsFD: a vfork and an exec), so a
// namespace is reused: every sandbox of a slot index has the same mapping,
// and its own container runs in a user namespace with exactly that mapping, made by the
// runtime from the spec. When a sandbox stops, its init's namespace is kept (keeper) for
// the next create on that slot, which takes it (get); only a slot never used before, or
// whose last sandbox's init was already gone, makes one. The cache holds namespaces of
// free slots only: one held per running sandbox, as before, was a descriptor per sandbox
// in the node, which every process the node starts copies and closes again at exec. These
// fds never reach a sandbox.
type usernsCache struct {
	mu   sync.Mutex
	fds  map[idMap]int // nil once closed
	made int           // namespaces made by a child, for tests
}

func newUsernsCache() *usernsCache { return &usernsCache{fds: map[idMap]int{}} }

// get returns an fd of a user namespace with mapping m, which the caller closes.
func (c *usernsCache) get(m idMap) (int, error) {
	c.mu.Lock()
	if c.fds == nil {
		c.mu.Unlock()
		return -1, errors.New("oci: backend closed")
	}
	fd, ok := c.fds[m]
	delete(c.fds, m)
	c.mu.Unlock()
	if ok {
		return fd, nil
	}
	fd, err := usernsFD(m)
	if err == nil {
		c.mu.Lock()
		c.made++
		c.mu.Unlock()
	}
	return fd, err
}

// put keeps fd, a user namespace with mapping m, for the next get of m; the cache owns
// it from here.
func (c *usernsCache) put(m idMap, fd int) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if _, dup := c.fds[m]; c.fds == nil || dup || len(c.fds) >= maxKeptUserns {
		unix.Close(fd)
		return
	}
	c.fds[m] = fd
}

// keeper returns killInit's last look for a sandbox whose user namespace has mapping m
// (nil for none): it keeps the init's user namespace when it still is the one the
// runtime made, with exactly the mapping m. The sandbox's processes can make nested user
// namespaces, and its init too; one of those, with another mapping, must never reach
// the next sandbox on the slot.
func (c *usernsCache) keeper(m *idMap) func(pid, pidfd int) {
	if m == nil {
		return nil
	}
	want := *m
	return func(pid, pidfd int) {
		fd, err := unix.Open(fmt.Sprintf("/proc/%d/ns/user", pid), unix.O_RDONLY|unix.O_CLOEXEC, 0)
		if err != nil {
			return
		}
		// The maps are read after the open, so a namespace the init entered after it
		// fails the check too; and the pidfd shows the init still alive after both, so
		// the pid named the same process throughout.
		if !mapsAre(pid, want) || exited(pidfd) {
			unix.Close(fd)
			return
		}
		c.put(want, fd)
	}
}

// initUserns returns an fd of the user namespace of warm container init pid, whose
// mapping is m, for the id-mapped mount of the root it is moved onto. The runtime made
// that namespace with the container, and nothing of a sandbox's has run in it yet, so it
// is used as it is: getting one from the cache instead made one by a fork whenever the
// cache had none for m (a slot's first sandbox), serialized, on every such child's path.
// The cache's is the fallback should the init's not be what the runtime made.
func (b *Backend) initUserns(pid int, m idMap) (int, error) {
	fd, err := unix.Open(fmt.Sprintf("/proc/%d/ns/user", pid), unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err == nil && mapsAre(pid, m) {
		return fd, nil
	}
	if err == nil {
		unix.Close(fd)
	}
	return b.usernsFDs.get(m)
}

// mapsAre reports whether process pid's user namespace maps ids exactly as m does, for
// users and for groups, as seen from the node's namespace.
func mapsAre(pid int, m idMap) bool {
	want := m.mapLine()
	for _, f := range []string{"uid_map", "gid_map"} {
		raw, err := os.ReadFile(fmt.Sprintf("/proc/%d/%s", pid, f))
		if err != nil || strings.Join(strings.Fields(string(raw)), " ") != want {
			return false
		}
	}
	return true
}

// exited reports whether the process of pidfd has exited (its pidfd is readable then).
func exited(pidfd int) bool {
	fds := []unix.PollFd{{Fd: int32(pidfd), Events: unix.POLLIN}}
	n, err := unix.Poll(fds, 0)
	return err != nil || n > 0
}

// close closes every fd; get fails afterwards.
func (c *usernsCache) close() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	var errs []error
	for m, fd := range c.fds {
		if err := unix.Close(fd); err != nil {
			errs = append(errs, fmt.Errorf("oci: close user namespace %+v: %w", m, err))
		}
	}
	c.fds = nil
	return errors.Join(errs...)
}
