package identity

import (
	"errors"
	"os"
	"path/filepath"
	"slices"
	"testing"
)

func TestResolve(t *testing.T) {
	u := &User{Name: "user", Home: "/home/user"}
	for _, c := range []struct{ in, workdir, want string }{
		{"", "", "/home/user"},
		{"", "/srv/app", "/srv/app"},
		{"~", "/srv", "/home/user"},
		{"~/a/../b", "", "/home/user/b"},
		{"rel/x", "/srv", "/home/user/rel/x"},
		{"/abs//y/", "", "/abs/y"},
		{"../../etc", "", "/etc"},
	} {
		if got := Resolve(c.in, u, c.workdir); got != c.want {
			t.Errorf("Resolve(%q, %q) = %q, want %q", c.in, c.workdir, got, c.want)
		}
	}
}

func TestBasicUser(t *testing.T) {
	for h, want := range map[string]string{
		"Basic cm9vdDo=":     "root",
		"basic dXNlcjo=":     "user",
		"Basic dXNlcjpwdw==": "user",
		"Bearer x":           "",
		"Basic !!!":          "",
		"Basic Og==":         "",
		"":                   "",
	} {
		got, ok := BasicUser(h)
		if got != want || ok != (want != "") {
			t.Errorf("%q: %q %v", h, got, ok)
		}
	}
}

func TestLookup(t *testing.T) {
	dir := t.TempDir()
	pw, gr := filepath.Join(dir, "passwd"), filepath.Join(dir, "group")
	_ = os.WriteFile(pw, []byte("# comment\nroot:x:0:0::/root:/bin/sh\nbad:x:notanumber:1::/:/bin/sh\nuser:x:1000:1000:U:/home/user:/bin/bash\n"), 0o644)
	_ = os.WriteFile(gr, []byte("root:x:0:\nuser:x:1000:\nwheel:x:10:root,user\ndocker:x:999:user\n"), 0o644)
	db := DB{PasswdPath: pw, GroupPath: gr}
	u, err := db.Lookup("user")
	if err != nil || u.UID != 1000 || u.GID != 1000 || u.Home != "/home/user" || !slices.Equal(u.Groups, []uint32{10, 999}) {
		t.Fatalf("%+v %v", u, err)
	}
	for _, name := range []string{"nobody", "bad", ""} {
		if _, err := db.Lookup(name); !errors.Is(err, ErrUnknownUser) {
			t.Errorf("%q: %v", name, err)
		}
	}
	// root always exists, even without a passwd file.
	if u, err := (DB{PasswdPath: filepath.Join(dir, "none")}).Lookup("root"); err != nil || u.UID != 0 || u.Home != "/root" {
		t.Fatalf("%+v %v", u, err)
	}
	n := db.Names()
	if n.User(1000) != "user" || n.User(5) != "5" || n.Group(10) != "wheel" || n.Group(77) != "77" {
		t.Fatal("names")
	}
}

func TestLookupMemo(t *testing.T) {
	dir := t.TempDir()
	pw, gr := filepath.Join(dir, "passwd"), filepath.Join(dir, "group")
	write := func(path, content string) {
		t.Helper()
		// A new file renamed onto the path, as useradd and vipw do.
		tmp := path + ".new"
		if err := os.WriteFile(tmp, []byte(content), 0o644); err != nil {
			t.Fatal(err)
		}
		if err := os.Rename(tmp, path); err != nil {
			t.Fatal(err)
		}
	}
	write(pw, "root:x:0:0::/root:/bin/sh\nuser:x:1000:1000::/home/user:/bin/bash\n")
	write(gr, "wheel:x:10:user\n")
	db := NewDB(pw, gr)
	lookup := func(name string, wantHome string, wantGroups []uint32, wantReads int) {
		t.Helper()
		u, err := db.Lookup(name)
		if err != nil {
			t.Fatal(err)
		}
		if u.Home != wantHome || !slices.Equal(u.Groups, wantGroups) {
			t.Fatalf("%s: %+v, want home %s groups %v", name, u, wantHome, wantGroups)
		}
		if db.memo.reads != wantReads {
			t.Fatalf("%s: %d reads of the files, want %d", name, db.memo.reads, wantReads)
		}
		u.Groups = append(u.Groups[:0], 4242) // the caller's copy
	}
	lookup("user", "/home/user", []uint32{10}, 1)
	lookup("user", "/home/user", []uint32{10}, 1)
	lookup("root", "/root", nil, 2)
	lookup("root", "/root", nil, 2)
	write(pw, "root:x:0:0::/root:/bin/sh\nuser:x:1000:1000::/srv/user:/bin/bash\n")
	lookup("user", "/srv/user", []uint32{10}, 3)
	write(gr, "wheel:x:10:user\ndocker:x:999:user\n")
	lookup("user", "/srv/user", []uint32{10, 999}, 4)
	lookup("user", "/srv/user", []uint32{10, 999}, 4)
	// Appended in place: the size changes.
	f, err := os.OpenFile(pw, os.O_APPEND|os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := f.WriteString("dev:x:1001:1001::/home/dev:/bin/bash\n"); err != nil {
		t.Fatal(err)
	}
	f.Close()
	lookup("dev", "/home/dev", nil, 5)
	// Unknown users are not remembered, and the group file may go.
	for i := 0; i < 2; i++ {
		if _, err := db.Lookup("nobody"); !errors.Is(err, ErrUnknownUser) {
			t.Fatal(err)
		}
	}
	if db.memo.reads != 7 {
		t.Fatalf("%d reads after two unknown users, want 7", db.memo.reads)
	}
	if err := os.Remove(gr); err != nil {
		t.Fatal(err)
	}
	lookup("user", "/srv/user", nil, 8)
}
