package posixfs

import (
	"context"
	crand "crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"syscall"
	"time"

	"github.com/aenv-dev/aenv/internal/repository"
)

// lockOwner is the content of a lock file. flock and fcntl locks are not
// reliable across NFS clients (and vanish silently on some servers), so a
// lock is a file created with O_CREAT|O_EXCL, which NFSv3+ performs
// atomically on the server, naming who holds it so that others can decide
// whether it is stale.
type lockOwner struct {
	Host    string    `json:"host"`
	PID     int       `json:"pid"`
	Token   string    `json:"token"`
	Created time.Time `json:"created"`
}

type heldLock struct {
	path  string
	token string
	taken time.Time
}

func newToken() string {
	var b [12]byte
	_, _ = crand.Read(b[:]) // never fails on Linux
	return hex.EncodeToString(b[:])
}

// lock takes the lock file at path, waiting up to the configured timeout and
// taking over locks that are stale: older than StaleLockAge (the holder died
// on another host, or hangs), or held by a dead process on this host.
func (r *Repo) lock(ctx context.Context, path string) (*heldLock, error) {
	me := lockOwner{Host: r.host, PID: os.Getpid(), Token: newToken()}
	deadline := time.Now().Add(r.o.LockTimeout)
	for attempt := 0; ; attempt++ {
		me.Created = time.Now().UTC()
		b, _ := json.Marshal(me)
		f, err := os.OpenFile(path, os.O_CREATE|os.O_EXCL|os.O_WRONLY, 0o644)
		if err == nil {
			_, werr := f.Write(b)
			if werr == nil {
				werr = f.Sync()
			}
			if cerr := f.Close(); werr == nil {
				werr = cerr
			}
			if werr != nil {
				os.Remove(path)
				return nil, fmt.Errorf("posixfs: write lock %s: %w", path, werr)
			}
			return &heldLock{path: path, token: me.Token, taken: time.Now()}, nil
		}
		if !errors.Is(err, os.ErrExist) {
			return nil, fmt.Errorf("posixfs: lock %s: %w", path, err)
		}
		if r.takeOverIfStale(path) {
			continue
		}
		if time.Now().After(deadline) {
			return nil, fmt.Errorf("%w: %s held for over %s", repository.ErrLocked, path, r.o.LockTimeout)
		}
		wait := time.Duration(5+rand.IntN(20)) * time.Millisecond << min(attempt, 3)
		select {
		case <-ctx.Done():
			return nil, ctx.Err()
		case <-time.After(wait):
		}
	}
}

// takeOverIfStale removes a stale lock and reports whether it did. Removal
// is rename-then-check: only one contender's rename of a given lock file
// succeeds, and if the file renamed turns out not to be the stale one judged
// (it was replaced in between by a live holder), it is put back.
func (r *Repo) takeOverIfStale(path string) bool {
	st, err := os.Stat(path)
	if err != nil {
		return errors.Is(err, os.ErrNotExist) // gone already: retry now
	}
	b, _ := os.ReadFile(path)
	var owner lockOwner
	parsed := json.Unmarshal(b, &owner) == nil && owner.Token != ""
	age := time.Since(st.ModTime())
	stale := age > r.o.StaleLockAge
	if parsed && !stale && owner.Host == r.host && owner.PID != os.Getpid() && !processAlive(owner.PID) {
		stale = true
	}
	if !stale {
		return false
	}
	aside := path + ".stale-" + newToken()
	if err := os.Rename(path, aside); err != nil {
		return false
	}
	if b2, err := os.ReadFile(aside); err == nil && string(b2) != string(b) {
		// Not the file judged stale: restore it unless someone holds the lock
		// again already.
		_ = os.Link(aside, path)
		os.Remove(aside)
		return false
	}
	os.Remove(aside)
	r.o.Logger.Warn("posixfs: took over stale lock", "path", path, "holder_host", owner.Host,
		"holder_pid", owner.PID, "age", age.Round(time.Millisecond))
	return true
}

func processAlive(pid int) bool {
	if pid <= 0 {
		return false
	}
	err := syscall.Kill(pid, 0)
	return err == nil || errors.Is(err, syscall.EPERM)
}

// unlock removes the lock if it is still ours; a lock taken over as stale
// while we held it is left to its new holder.
func (r *Repo) unlock(l *heldLock) {
	b, err := os.ReadFile(l.path)
	if err != nil {
		r.o.Logger.Warn("posixfs: lock vanished while held", "path", l.path, "err", err)
		return
	}
	var owner lockOwner
	if json.Unmarshal(b, &owner) != nil || owner.Token != l.token {
		r.o.Logger.Warn("posixfs: lock taken over while held", "path", l.path, "held", time.Since(l.taken))
		return
	}
	os.Remove(l.path)
}
