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
	"strconv"
	"strings"
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

// DB reads users and groups from passwd/group files. The zero value reads /etc/passwd and /etc/group.
type DB struct {
	PasswdPath string
	GroupPath  string
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
func eachLine(path string, fn func(f []string) bool) error {
	fh, err := os.Open(path)
	if err != nil {
		return err
	}
	defer fh.Close()
	sc := bufio.NewScanner(fh)
	sc.Buffer(make([]byte, 64*1024), 1024*1024)
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
