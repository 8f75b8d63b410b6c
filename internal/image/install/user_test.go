package install

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/aenv-dev/aenv/internal/catalog"
	"github.com/aenv-dev/aenv/internal/image"
	"github.com/aenv-dev/aenv/internal/sandbox"
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
			ref := "oci:" + imageLayout(t, "img", c.imageUser, tarLayer(t, map[string]string{"etc/passwd": passwd, "bin/sh": "#!"}))
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

// TestRunRefusesUnusable: an image that cannot run sandboxes (no /etc/passwd, no
// /bin/sh, a home that cannot be made, a hostile /etc/passwd) is refused at pull time,
// converted or not, naming why, with nothing registered and no template directory left.
func TestRunRefusesUnusable(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root: unpacking sets ownership")
	}
	passwd := "root:x:0:0::/root:/bin/sh\n"
	for _, c := range []struct {
		name  string
		files map[string]string
		want  string
	}{
		{"no passwd", map[string]string{"bin/sh": "#!"}, "no /etc/passwd"},
		{"no sh", map[string]string{"etc/passwd": passwd, "bin/busybox": "#!"}, "no /bin/sh"},
		{"home a file", map[string]string{"etc/passwd": passwd, "bin/sh": "#!", "home": ""}, "home /home/user"},
		{"passwd line too long", map[string]string{"etc/passwd": passwd + strings.Repeat("x", 100<<10), "bin/sh": "#!"}, "line 2"},
	} {
		for _, conv := range []bool{false, true} {
			if conv && !canConvert() {
				continue
			}
			t.Run(fmt.Sprintf("%s/convert=%v", c.name, conv), func(t *testing.T) {
				data := t.TempDir()
				cat, err := catalog.Open(filepath.Join(data, "aenv.db"))
				if err != nil {
					t.Fatal(err)
				}
				defer cat.Close()
				ref := "oci:" + imageLayout(t, "img", "", tarLayer(t, c.files))
				_, err = Run(context.Background(), cat.Templates(), Request{Ref: ref, DataDir: data, Name: "u", Convert: conv,
					Resources: sandbox.Resources{DiskSizeMB: 32}})
				if !errors.Is(err, image.ErrUnusableImage) || !strings.Contains(err.Error(), c.want) {
					t.Fatalf("err = %v, want ErrUnusableImage naming %q", err, c.want)
				}
				if ts, _ := cat.Templates().List(catalog.KindTemplate); len(ts) != 0 {
					t.Errorf("refused pull registered %d templates", len(ts))
				}
				if ents, _ := os.ReadDir(filepath.Join(data, TemplatesDir)); len(ents) != 0 {
					t.Errorf("refused pull left %d template dirs", len(ents))
				}
			})
		}
	}
}

// canConvert reports whether this host can convert images (root, FUSE, loop devices).
func canConvert() bool {
	for _, p := range []string{"/dev/fuse", "/dev/loop-control"} {
		if _, err := os.Stat(p); err != nil {
			return false
		}
	}
	return os.Geteuid() == 0
}
