package oci

import (
	"errors"
	"fmt"
	"sync"

	"golang.org/x/sys/unix"
)

// usernsCache keeps one user namespace fd per id mapping, for the id-mapped mounts of
// sandbox roots. Making one forks the node process (Go cannot unshare a user namespace in
// a multithreaded process, and a fork with CLONE_NEWUSER copies every page table of this
// large process): 5 % of the node's CPU in a 16-way create. A namespace without processes
// is only a mapping, and every sandbox of a slot index has the same mapping, so each is
// made once and reused. The container's own user namespace is still made by the runtime
// from the spec's mappings; these fds never reach a sandbox.
//
// Making is serialized: Go's child for a user namespace waits on a pipe for its id maps,
// and two such forks in flight hold each other's pipe open, so a node killed between them
// would leave both children waiting forever with every fd of the node (its catalog lock,
// its API socket). One at a time, a killed node's child sees its pipe close and exits.
type usernsCache struct {
	making sync.Mutex
	mu     sync.Mutex
	fds    map[idMap]int
}

func newUsernsCache() *usernsCache { return &usernsCache{fds: map[idMap]int{}} }

// get returns the fd of a user namespace with mapping m, owned by the cache (callers do
// not close it).
func (c *usernsCache) get(m idMap) (int, error) {
	c.mu.Lock()
	fd, ok := c.fds[m]
	c.mu.Unlock()
	if ok {
		return fd, nil
	}
	c.making.Lock()
	fd, err := usernsFD(m)
	c.making.Unlock()
	if err != nil {
		return -1, err
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.fds == nil {
		unix.Close(fd)
		return -1, errors.New("oci: backend closed")
	}
	if prev, ok := c.fds[m]; ok {
		// Made concurrently by another launch: keep one.
		unix.Close(fd)
		return prev, nil
	}
	c.fds[m] = fd
	return fd, nil
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
