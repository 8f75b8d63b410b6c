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
