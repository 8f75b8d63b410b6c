package node

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/aenv-dev/aenv/internal/catalog"
	"github.com/aenv-dev/aenv/internal/storage/blockdev"
)

// openCatalog opens the node's catalog, after ClearStaleHolder.
func openCatalog(ctx context.Context, dataDir, path string, log *slog.Logger) (*catalog.Catalog, error) {
	if err := clearStaleHolder(ctx, dataDir, path, log); err != nil {
		return nil, err
	}
	return catalog.Open(path)
}

// ClearStaleHolder is the stale-holder handling a node runs before it binds its port. A
// node killed with SIGKILL while one of its threads waited on a filesystem that the node
// itself served over FUSE (an unmount, a freeze) cannot finish exiting: that thread waits
// for a FUSE answer nobody will give, and the half-exited process keeps the catalog's
// file lock and the API port. When the holder is such a dying process, its FUSE
// connections under the data directory are aborted, which fails the stuck requests and
// lets it exit; this waits (up to 10 s) until it has. A live holder (another `aenv
// serve`) is never touched, and neither are the disks the data plane serves (it is alive:
// what waits on them gets its answer).
func ClearStaleHolder(ctx context.Context, dataDir string, log *slog.Logger) error {
	return clearStaleHolder(ctx, dataDir, filepath.Join(dataDir, CatalogFile), log)
}

func clearStaleHolder(ctx context.Context, dataDir, path string, log *slog.Logger) error {
	pid, ok := lockHolder(path)
	if !ok {
		return nil
	}
	if gone(pid) {
		return clearStranded(ctx, path, pid, log)
	}
	if !dying(pid) {
		return nil
	}
	log.Warn("the catalog is held by a node that was killed but cannot exit (a thread waits on its own FUSE mount); "+
		"aborting its FUSE connections", "pid", pid)
	if _, serr := blockdev.SweepLoops(ctx, dataDir, dataPlaneDirs(ctx, dataDir)...); serr != nil {
		log.Warn("sweep the dead node's block devices", "err", serr)
	}
	deadline := time.Now().Add(10 * time.Second)
	for {
		if p, held := lockHolder(path); !held || p != pid {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("the catalog is still held by the dying node %d", pid)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(100 * time.Millisecond):
		}
	}
}

// lockHolder finds the process holding a flock on path, from /proc/locks.
func lockHolder(path string) (int, bool) {
	var st syscall.Stat_t
	if err := syscall.Stat(path, &st); err != nil {
		return 0, false
	}
	f, err := os.Open("/proc/locks")
	if err != nil {
		return 0, false
	}
	defer f.Close()
	return findLockHolder(bufio.NewScanner(f), uint64(st.Dev), st.Ino)
}

// findLockHolder scans /proc/locks lines ("1: FLOCK  ADVISORY  WRITE 123 fd:01:456 0 EOF")
// for a lock on the file (dev, ino). The device is printed as major:minor in hex.
func findLockHolder(sc *bufio.Scanner, dev, ino uint64) (int, bool) {
	want := fmt.Sprintf("%02x:%02x:%d", unix.Major(dev), unix.Minor(dev), ino)
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		// Blocked waiters are listed as "1: -> FLOCK ..."; only holders count.
		if len(f) < 6 || f[1] != "FLOCK" || f[5] != want {
			continue
		}
		pid, err := strconv.Atoi(f[4])
		if err == nil && pid > 0 {
			return pid, true
		}
	}
	return 0, false
}

// gone reports whether no process pid exists.
func gone(pid int) bool {
	return syscall.Kill(pid, 0) == syscall.ESRCH
}

// dying reports whether pid is a process that is exiting: its main thread has already
// exited (a zombie) while other threads have not.
func dying(pid int) bool {
	raw, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return false
	}
	return statState(string(raw)) == 'Z'
}

// statState returns the state letter of a /proc/PID/stat line; the command name
// before it is in parentheses and may itself contain spaces and parentheses.
func statState(stat string) byte {
	i := strings.LastIndexByte(stat, ')')
	if i < 0 || i+2 >= len(stat) {
		return 0
	}
	return stat[i+2]
}

// Listen binds addr. A predecessor that ClearStaleHolder saw exit may hold the port a
// moment longer (its sockets close as its last thread exits), so EADDRINUSE is retried
// briefly.
func Listen(ctx context.Context, addr string) (net.Listener, error) {
	deadline := time.Now().Add(5 * time.Second)
	for {
		ln, err := net.Listen("tcp", addr)
		if err == nil || !errors.Is(err, syscall.EADDRINUSE) || time.Now().After(deadline) {
			return ln, err
		}
		select {
		case <-ctx.Done():
			return nil, ctx.Err()
		case <-time.After(100 * time.Millisecond):
		}
	}
}
