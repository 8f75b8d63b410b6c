package unpack

import (
	"archive/tar"
	"bytes"
	"context"
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/aenv-dev/aenv/internal/image/imagetest"
	"golang.org/x/sys/unix"
)

// ent is one tar entry a test layer is made of.
type ent struct {
	name, link string
	typ        byte
	body       string
	mode       int64
	uid, gid   int
	major      int64
	minor      int64
	xattrs     map[string]string
}

var epoch = time.Unix(1_600_000_000, 0)

func mkTar(t testing.TB, ents ...ent) []byte {
	t.Helper()
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	for _, e := range ents {
		h := &tar.Header{Name: e.name, Linkname: e.link, Typeflag: e.typ, Mode: e.mode,
			Uid: e.uid, Gid: e.gid, ModTime: epoch, Devmajor: e.major, Devminor: e.minor, Format: tar.FormatPAX}
		if h.Typeflag == 0 {
			h.Typeflag = tar.TypeReg
		}
		if h.Mode == 0 {
			h.Mode = 0o644
			if h.Typeflag == tar.TypeDir {
				h.Mode = 0o755
			}
		}
		if h.Typeflag == tar.TypeReg {
			h.Size = int64(len(e.body))
		}
		for k, v := range e.xattrs {
			if h.PAXRecords == nil {
				h.PAXRecords = map[string]string{}
			}
			h.PAXRecords["SCHILY.xattr."+k] = v
		}
		if err := tw.WriteHeader(h); err != nil {
			t.Fatal(err)
		}
		if h.Typeflag == tar.TypeReg {
			if _, err := tw.Write([]byte(e.body)); err != nil {
				t.Fatal(err)
			}
		}
	}
	if err := tw.Close(); err != nil {
		t.Fatal(err)
	}
	return buf.Bytes()
}

func apply(t testing.TB, root string, layer []byte) (Stats, error) {
	t.Helper()
	return Apply(context.Background(), root, bytes.NewReader(layer), Options{})
}

// listing describes a tree as sorted "path mode [uid:gid] [content|target]" lines (owners
// only as root, where unpacking can set them).
func listing(t testing.TB, root string) []string {
	t.Helper()
	return imagetest.Tree(t, root, os.Geteuid() == 0)
}

func TestApplyEntryKinds(t *testing.T) {
	root := t.TempDir()
	layer := mkTar(t,
		ent{name: "./", typ: tar.TypeDir, mode: 0o755},
		ent{name: "etc/", typ: tar.TypeDir, mode: 0o755},
		ent{name: "etc/passwd", body: "root:x:0:0::/root:/bin/sh\n"},
		ent{name: "bin/tool", body: "#!/bin/sh\n", mode: 0o4755, uid: 0, gid: 0},
		ent{name: "home/user/", typ: tar.TypeDir, mode: 0o700, uid: 1000, gid: 1000},
		ent{name: "home/user/notes", body: "hi", mode: 0o600, uid: 1000, gid: 1000},
		ent{name: "bin/sh", typ: tar.TypeSymlink, link: "/bin/tool"},
		ent{name: "bin/tool2", typ: tar.TypeLink, link: "bin/tool"},
		ent{name: "tmp/", typ: tar.TypeDir, mode: 0o1777},
		ent{name: "run/fifo", typ: tar.TypeFifo, mode: 0o600},
		ent{name: "dev/null", typ: tar.TypeChar, mode: 0o666, major: 1, minor: 3},
		ent{name: "data", body: "x", xattrs: map[string]string{"user.aenv": "v1"}},
	)
	st, err := apply(t, root, layer)
	if err != nil {
		t.Fatal(err)
	}
	if st.Files != 4 || st.Symlinks != 1 || st.Hardlinks != 1 {
		t.Errorf("stats = %+v", st)
	}
	got := strings.Join(listing(t, root), "\n")
	for _, want := range []string{
		"etc/passwd -rw-r--r--",
		"bin/tool urwxr-xr-x",
		"bin/sh Lrwxrwxrwx",
		"-> /bin/tool",
		"tmp dtrwxrwxrwx",
		"run/fifo prw-------",
		"home/user/notes -rw-------",
	} {
		if !strings.Contains(got, want) {
			t.Errorf("tree lacks %q:\n%s", want, got)
		}
	}
	var a, b unix.Stat_t
	unix.Lstat(filepath.Join(root, "bin/tool"), &a)
	unix.Lstat(filepath.Join(root, "bin/tool2"), &b)
	if a.Ino != b.Ino || a.Nlink != 2 {
		t.Errorf("hard link: inodes %d/%d nlink %d", a.Ino, b.Ino, a.Nlink)
	}
	fi, err := os.Lstat(filepath.Join(root, "etc"))
	if err != nil || !fi.ModTime().Equal(epoch) {
		t.Errorf("etc mtime = %v (%v), want %v", fi.ModTime(), err, epoch)
	}
	fi, _ = os.Lstat(filepath.Join(root, "bin/sh"))
	if !fi.ModTime().Equal(epoch) {
		t.Errorf("symlink mtime = %v", fi.ModTime())
	}
	if os.Geteuid() != 0 {
		t.Log("not root: ownership and device nodes not checked")
		return
	}
	if !strings.Contains(got, "home/user/notes -rw------- 1000:1000 hi") {
		t.Errorf("ownership not applied:\n%s", got)
	}
	var d unix.Stat_t
	if err := unix.Lstat(filepath.Join(root, "dev/null"), &d); err != nil || d.Mode&unix.S_IFMT != unix.S_IFCHR || unix.Major(d.Rdev) != 1 || unix.Minor(d.Rdev) != 3 {
		t.Errorf("dev/null: %v mode %o rdev %d", err, d.Mode, d.Rdev)
	}
	buf := make([]byte, 16)
	if n, err := unix.Lgetxattr(filepath.Join(root, "data"), "user.aenv", buf); err != nil || string(buf[:n]) != "v1" {
		t.Errorf("xattr = %q, %v", buf[:n], err)
	}
}

func TestApplyWhiteouts(t *testing.T) {
	root := t.TempDir()
	base := mkTar(t,
		ent{name: "a/", typ: tar.TypeDir},
		ent{name: "a/keep", body: "k"},
		ent{name: "a/gone", body: "g"},
		ent{name: "a/sub/", typ: tar.TypeDir},
		ent{name: "a/sub/deep", body: "d"},
		ent{name: "o/", typ: tar.TypeDir},
		ent{name: "o/old1", body: "1"},
		ent{name: "o/olddir/", typ: tar.TypeDir},
		ent{name: "o/olddir/x", body: "x"},
		ent{name: "o/n/", typ: tar.TypeDir},
		ent{name: "o/n/lower", body: "l"},
		ent{name: "top", body: "t"},
	)
	upper := mkTar(t,
		ent{name: "a/.wh.gone", body: ""},
		ent{name: "a/.wh.sub", body: ""},
		ent{name: ".wh.top", body: ""},
		ent{name: ".wh.missing", body: ""},
		ent{name: "o/new-before", body: "b"},
		ent{name: "o/n/upper", body: "u"},
		ent{name: "o/.wh..wh..opq", body: ""},
		ent{name: "o/new-after", body: "a"},
		ent{name: "a/.wh..wh.plnk", body: ""},
	)
	for _, l := range [][]byte{base, upper} {
		if _, err := apply(t, root, l); err != nil {
			t.Fatal(err)
		}
	}
	var got []string
	for _, l := range listing(t, root) {
		got = append(got, strings.Fields(l)[0])
	}
	want := []string{"a", "a/keep", "o", "o/n", "o/n/upper", "o/new-after", "o/new-before"}
	if strings.Join(got, ",") != strings.Join(want, ",") {
		t.Errorf("tree = %v, want %v", got, want)
	}
}

func TestApplyReplaces(t *testing.T) {
	root := t.TempDir()
	outside := t.TempDir()
	canary := filepath.Join(outside, "canary")
	os.WriteFile(canary, []byte("safe"), 0o644)
	l1 := mkTar(t,
		ent{name: "x", typ: tar.TypeSymlink, link: canary},
		ent{name: "d/", typ: tar.TypeDir},
		ent{name: "d/f", body: "f"},
		ent{name: "f", body: "file"},
	)
	l2 := mkTar(t,
		ent{name: "x", body: "replaced"},   // replaces the link, never writes through it
		ent{name: "d", body: "now a file"}, // a file replaces a directory tree
		ent{name: "f/", typ: tar.TypeDir},  // a directory replaces a file
		ent{name: "f/inner", body: "in"},
	)
	for _, l := range [][]byte{l1, l2} {
		if _, err := apply(t, root, l); err != nil {
			t.Fatal(err)
		}
	}
	if b, _ := os.ReadFile(canary); string(b) != "safe" {
		t.Fatalf("canary outside the root changed: %q", b)
	}
	for p, want := range map[string]string{"x": "replaced", "d": "now a file", "f/inner": "in"} {
		if b, err := os.ReadFile(filepath.Join(root, p)); err != nil || string(b) != want {
			t.Errorf("%s = %q, %v; want %q", p, b, err, want)
		}
	}
}

// TestApplyTraversal feeds hostile layers to a root that has a sibling
// directory; nothing outside the root may change, and names that are unsafe
// on their face are refused.
func TestApplyTraversal(t *testing.T) {
	cases := []struct {
		name    string
		ents    []ent
		wantErr error // nil: must succeed, with writes redirected inside the root
		inside  string
	}{
		{name: "dotdot", ents: []ent{{name: "../evil", body: "x"}}, wantErr: ErrUnsafePath},
		{name: "dotdot-deep", ents: []ent{{name: "a/../../evil", body: "x"}}, wantErr: ErrUnsafePath},
		{name: "absolute", ents: []ent{{name: "/evil", body: "x"}}, wantErr: ErrUnsafePath},
		{name: "hardlink-out", ents: []ent{{name: "h", typ: tar.TypeLink, link: "../outside/canary"}}, wantErr: ErrUnsafePath},
		{name: "hardlink-abs", ents: []ent{{name: "h", typ: tar.TypeLink, link: "/etc/passwd"}}, wantErr: ErrUnsafePath},
		{name: "whiteout-dotdot", ents: []ent{{name: "a/.wh..."}}, wantErr: ErrUnsafePath},
		{name: "symlink-abs-then-write", ents: []ent{
			{name: "l", typ: tar.TypeSymlink, link: "/"},
			{name: "l/evil", body: "x"},
		}, inside: "evil"},
		{name: "symlink-rel-then-write", ents: []ent{
			{name: "l", typ: tar.TypeSymlink, link: "../../../../../.."},
			{name: "l/evil", body: "x"},
		}, inside: "evil"},
		{name: "symlink-to-outside-dir", ents: []ent{
			{name: "l", typ: tar.TypeSymlink, link: "OUTSIDE"},
			{name: "l/canary", body: "pwned"},
		}, inside: "OUTSIDE/canary"},
		{name: "symlink-chain", ents: []ent{
			{name: "a", typ: tar.TypeSymlink, link: "b/.."},
			{name: "b", typ: tar.TypeSymlink, link: "../../.."},
			{name: "a/evil", body: "x"},
		}, inside: "evil"},
		{name: "hardlink-through-symlink", ents: []ent{
			{name: "l", typ: tar.TypeSymlink, link: "OUTSIDE"},
			{name: "h", typ: tar.TypeLink, link: "l/canary"},
		}, wantErr: fs.ErrNotExist},
		{name: "whiteout-through-symlink", ents: []ent{
			{name: "l", typ: tar.TypeSymlink, link: "OUTSIDE"},
			{name: "l/.wh.canary"},
		}},
		{name: "opaque-through-symlink", ents: []ent{
			{name: "l", typ: tar.TypeSymlink, link: "OUTSIDE"},
			{name: "l/.wh..wh..opq"},
		}},
		{name: "symlink-loop", ents: []ent{
			{name: "a", typ: tar.TypeSymlink, link: "b"},
			{name: "b", typ: tar.TypeSymlink, link: "a"},
			{name: "a/x", body: "x"},
		}, wantErr: errAny},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			top := t.TempDir()
			root := filepath.Join(top, "root")
			outside := filepath.Join(top, "outside")
			os.Mkdir(root, 0o755)
			os.Mkdir(outside, 0o755)
			canary := filepath.Join(outside, "canary")
			os.WriteFile(canary, []byte("safe"), 0o644)
			ents := make([]ent, len(tc.ents))
			for i, e := range tc.ents {
				e.link = strings.ReplaceAll(e.link, "OUTSIDE", outside)
				ents[i] = e
			}
			_, err := apply(t, root, mkTar(t, ents...))
			switch {
			case tc.wantErr == errAny:
				if err == nil {
					t.Error("no error")
				}
			case tc.wantErr != nil && !errors.Is(err, tc.wantErr):
				t.Errorf("err = %v, want %v", err, tc.wantErr)
			case tc.wantErr == nil && err != nil:
				t.Errorf("err = %v", err)
			}
			entries, _ := os.ReadDir(top)
			if len(entries) != 2 {
				t.Errorf("something was created next to the root: %v", entries)
			}
			if b, err := os.ReadFile(canary); err != nil || string(b) != "safe" {
				t.Errorf("canary outside the root = %q, %v", b, err)
			}
			if out, _ := os.ReadDir(outside); len(out) != 1 {
				t.Errorf("outside dir now holds %v", out)
			}
			if tc.inside != "" {
				p := filepath.Join(root, strings.ReplaceAll(tc.inside, "OUTSIDE", outside))
				if _, err := os.Lstat(p); err != nil {
					t.Errorf("write was not redirected inside the root: %v", err)
				}
			}
		})
	}
}

var errAny = errors.New("any error")

func TestApplyCancelled(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	_, err := Apply(ctx, t.TempDir(), bytes.NewReader(mkTar(t, ent{name: "a", body: "a"})), Options{})
	if !errors.Is(err, context.Canceled) {
		t.Fatalf("err = %v", err)
	}
}

func TestApplyTruncated(t *testing.T) {
	l := mkTar(t, ent{name: "a", body: strings.Repeat("x", 4096)})
	_, err := apply(t, t.TempDir(), l[:1024])
	if err == nil {
		t.Fatal("truncated layer applied without error")
	}
}
