package install

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/aenv-dev/aenv/internal/catalog"
)

// TestRunDefaultUser: a pull makes the image's USER (a name or a uid, with or without a
// group) the template's default user, as builds do; --user overrides it; a USER without
// an account falls back to `user`; a requested user without one is refused with nothing
// registered. The account `user` with home /home/user exists in every case.
func TestRunDefaultUser(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root: unpacking sets ownership")
	}
	passwd := "root:x:0:0::/root:/bin/sh\napp:x:1001:1001::/srv/app:/bin/sh\n"
	for _, c := range []struct {
		name, imageUser, flag, want string
		err                         error
	}{
		{name: "no USER", want: "user"},
		{name: "USER name", imageUser: "app", want: "app"},
		{name: "USER uid:gid", imageUser: "1001:1001", want: "app"},
		{name: "USER root uid", imageUser: "0", want: "root"},
		{name: "USER without account", imageUser: "4242", want: "user"},
		{name: "flag overrides USER", imageUser: "app", flag: "root", want: "root"},
		{name: "flag uid", flag: "1001", want: "app"},
		{name: "flag without account", imageUser: "app", flag: "ghost", err: ErrUnknownUser},
	} {
		t.Run(c.name, func(t *testing.T) {
			data := t.TempDir()
			cat, err := catalog.Open(filepath.Join(data, "aenv.db"))
			if err != nil {
				t.Fatal(err)
			}
			defer cat.Close()
			ref := "oci:" + imageLayout(t, "img", c.imageUser, tarLayer(t, map[string]string{"etc/passwd": passwd}))
			tpl, err := Run(context.Background(), cat.Templates(), Request{Ref: ref, DataDir: data, Name: "u", User: c.flag})
			if c.err != nil {
				if !errors.Is(err, c.err) {
					t.Fatalf("err = %v, want %v", err, c.err)
				}
				if _, err := cat.Templates().Resolve("u"); !errors.Is(err, catalog.ErrNotFound) {
					t.Errorf("refused pull registered: %v", err)
				}
				if ents, _ := os.ReadDir(filepath.Join(data, TemplatesDir)); len(ents) != 0 {
					t.Errorf("refused pull left %d template dirs", len(ents))
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if tpl.DefaultUser != c.want || tpl.DefaultWorkdir != "/home/user" {
				t.Errorf("default user %q workdir %q, want %q /home/user", tpl.DefaultUser, tpl.DefaultWorkdir, c.want)
			}
			b, err := os.ReadFile(filepath.Join(tpl.RootFSDir, "etc/passwd"))
			if err != nil || !strings.Contains(string(b), "\nuser:x:") {
				t.Errorf("account user missing: %q (%v)", b, err)
			}
			if fi, err := os.Stat(filepath.Join(tpl.RootFSDir, "home/user")); err != nil || !fi.IsDir() {
				t.Errorf("/home/user: %v", err)
			}
		})
	}
}
