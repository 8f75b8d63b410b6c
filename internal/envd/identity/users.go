// Package identity resolves the Linux user a request acts as (HTTP Basic auth, else the sandbox
// default) from /etc/passwd and /etc/group, and resolves request paths against that user's home.
// It parses the files itself so that envd stays static (no cgo, no NSS) and tests can point it
// at their own files.
package identity

import (
	"bufio"
	"encoding/base64"
	"errors"
	"fmt"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"

	"golang.org/x/sys/unix"
)

// ErrUnknownUser is returned when a user name is not in the passwd file.
var ErrUnknownUser = errors.New("unknown user")

// User is one passwd entry plus its supplementary groups.
type User struct {
	Name   string
	UID    uint32
	GID    uint32
	Home   string
	Groups []uint32 // supplementary groups from the group file
}

// DB reads users and groups from passwd/group files. The zero value reads /etc/passwd and
// /etc/group on every lookup; NewDB's also remembers what it found while the files stay
// as they were.
type DB struct {
	PasswdPath string
	GroupPath  string
	memo       *memo
}

// NewDB returns a DB of the files at passwd and group ("" for /etc's) that remembers the
// users it looked up.
func NewDB(passwd, group string) DB {
	return DB{PasswdPath: passwd, GroupPath: group, memo: &memo{users: map[string]User{}}}
}

func (d DB) passwd() string {
	if d.PasswdPath != "" {
		return d.PasswdPath
	}
	return "/etc/passwd"
}

func (d DB) group() string {
	if d.GroupPath != "" {
		return d.GroupPath
	}
	return "/etc/group"
}

// eachLine calls fn with the colon-separated fields of every non-comment line of path.
// Lines may be up to 1 MiB long; the buffer starts small (the scanner's 4 KiB) and grows
// only for longer ones: a 64 KiB buffer per file per lookup was fresh memory for an envd
// whose collector runs rarely (see lazygc), ~0.1 ms of page faults and zeroing a lookup.
func eachLine(path string, fn func(f []string) bool) error {
	fh, err := os.Open(path)
	if err != nil {
		return err
	}
	defer fh.Close()
	sc := bufio.NewScanner(fh)
	sc.Buffer(nil, 1024*1024)
	for sc.Scan() {
		line := sc.Text()
		if line == "" || line[0] == '#' {
			continue
		}
		if !fn(strings.Split(line, ":")) {
			return nil
		}
	}
	return sc.Err()
}

// Lookup finds a user by name. Unknown names wrap ErrUnknownUser.
func (d DB) Lookup(name string) (*User, error) {
	if name == "" {
		return nil, fmt.Errorf("%w: empty name", ErrUnknownUser)
	}
	if d.memo == nil {
		return d.read(name)
	}
	return d.memo.lookup(d, name)
}

// read looks name up in the files.
func (d DB) read(name string) (*User, error) {
	var u *User
	err := eachLine(d.passwd(), func(f []string) bool {
		if len(f) < 7 || f[0] != name {
			return true
		}
		uid, err1 := strconv.ParseUint(f[2], 10, 32)
		gid, err2 := strconv.ParseUint(f[3], 10, 32)
		if err1 != nil || err2 != nil {
			return true
		}
		u = &User{Name: f[0], UID: uint32(uid), GID: uint32(gid), Home: f[5]}
		return false
	})
	if err != nil && !errors.Is(err, os.ErrNotExist) {
		return nil, fmt.Errorf("read %s: %w", d.passwd(), err)
	}
	if u == nil {
		if name == "root" { // a rootfs without /etc/passwd still has root
			return &User{Name: "root", Home: "/root"}, nil
		}
		return nil, fmt.Errorf("%w: %q", ErrUnknownUser, name)
	}
	_ = eachLine(d.group(), func(f []string) bool {
		if len(f) < 4 || f[3] == "" {
			return true
		}
		for _, m := range strings.Split(f[3], ",") {
			if m == name {
				if gid, err := strconv.ParseUint(f[2], 10, 32); err == nil && uint32(gid) != u.GID {
					u.Groups = append(u.Groups, uint32(gid))
				}
				break
			}
		}
		return true
	})
	return u, nil
}

// Names maps numeric ids to user and group names; load it once per request.
type Names struct {
	users  map[uint32]string
	groups map[uint32]string
}

// Names reads both files once. Missing files give numeric names.
func (d DB) Names() *Names {
	n := &Names{users: map[uint32]string{}, groups: map[uint32]string{}}
	load := func(path string, into map[uint32]string) {
		_ = eachLine(path, func(f []string) bool {
			if len(f) >= 3 {
				if id, err := strconv.ParseUint(f[2], 10, 32); err == nil {
					if _, dup := into[uint32(id)]; !dup {
						into[uint32(id)] = f[0]
					}
				}
			}
			return true
		})
	}
	load(d.passwd(), n.users)
	load(d.group(), n.groups)
	return n
}

// User returns the name of uid, or the number as a string.
func (n *Names) User(uid uint32) string {
	if s, ok := n.users[uid]; ok {
		return s
	}
	return strconv.FormatUint(uint64(uid), 10)
}

// Group returns the name of gid, or the number as a string.
func (n *Names) Group(gid uint32) string {
	if s, ok := n.groups[gid]; ok {
		return s
	}
	return strconv.FormatUint(uint64(gid), 10)
}

// BasicUser extracts the user name from an "Authorization: Basic base64(user:password)" header.
// ok is false when there is no usable Basic header.
func BasicUser(authorization string) (name string, ok bool) {
	const prefix = "basic "
	if len(authorization) < len(prefix) || !strings.EqualFold(authorization[:len(prefix)], prefix) {
		return "", false
	}
	raw, err := base64.StdEncoding.DecodeString(strings.TrimSpace(authorization[len(prefix):]))
	if err != nil {
		return "", false
	}
	name, _, _ = strings.Cut(string(raw), ":")
	return name, name != ""
}

// memo remembers users found in the files as they were when they were read. envd looks
// the caller's user up on every RPC (Start, and CloseStdin, SendSignal... of the same
// command), each a read and parse of both files: ~1 ms of envd's ~4.5 ms of CPU per
// command run through `aenv exec` (three lookups), perf over 40 commands.
type memo struct {
	mu            sync.Mutex
	passwd, group stamp
	users         map[string]User
	reads         int // lookups that read the files (tests)
}

// stamp identifies a file's content as far as stat tells: another file (a rename onto
// the path, as useradd and vipw do), or a write (size, and the times the kernel sets).
type stamp struct {
	dev, ino     uint64
	size         int64
	mtime, ctime unix.Timespec
	missing      bool
}

func stampOf(path string) (stamp, error) {
	var st unix.Stat_t
	if err := unix.Stat(path, &st); err != nil {
		if errors.Is(err, unix.ENOENT) {
			return stamp{missing: true}, nil
		}
		return stamp{}, err
	}
	return stamp{dev: st.Dev, ino: st.Ino, size: st.Size, mtime: st.Mtim, ctime: st.Ctim}, nil
}

// lookup answers from what it remembers while both files have the stamps they had when it
// was read, and reads them (forgetting the rest) otherwise. A file that cannot be stat'ed
// is read every time.
func (m *memo) lookup(d DB, name string) (*User, error) {
	pw, perr := stampOf(d.passwd())
	gr, gerr := stampOf(d.group())
	if perr != nil || gerr != nil {
		return d.read(name)
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	if pw != m.passwd || gr != m.group {
		clear(m.users)
		m.passwd, m.group = pw, gr
	} else if u, ok := m.users[name]; ok {
		u.Groups = slices.Clone(u.Groups)
		return &u, nil
	}
	m.reads++
	u, err := d.read(name)
	if err != nil {
		return nil, err
	}
	c := *u
	c.Groups = slices.Clone(u.Groups)
	m.users[name] = c
	return u, nil
}
