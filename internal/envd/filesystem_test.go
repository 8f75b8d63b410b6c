package envd_test

import (
	"context"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"

	fspb "github.com/aenv-dev/aenv/internal/envd/gen/filesystem"
)

func TestStatMakeDirMoveRemove(t *testing.T) {
	e := newEnv(t, envOpts{})
	ctx := t.Context()

	// MakeDir: relative to home, parents created and owned by the user.
	r, err := e.fs.MakeDir(ctx, connect.NewRequest(&fspb.MakeDirRequest{Path: "a/b/c"}))
	if err != nil {
		t.Fatal(err)
	}
	ent := r.Msg.Entry
	if ent.Path != filepath.Join(e.home, "a/b/c") || ent.Name != "c" || ent.Type != fspb.FileType_FILE_TYPE_DIRECTORY || ent.Owner != e.user || ent.Permissions != "drwxr-xr-x" || ent.Mode != 0o755 {
		t.Fatalf("entry %v", ent)
	}
	if st, _ := e.fs.Stat(ctx, connect.NewRequest(&fspb.StatRequest{Path: "~/a"})); st.Msg.Entry.Owner != e.user {
		t.Fatalf("parent owner %v", st.Msg.Entry)
	}
	if _, err := e.fs.MakeDir(ctx, connect.NewRequest(&fspb.MakeDirRequest{Path: "a/b/c"})); codeOf(err) != connect.CodeAlreadyExists {
		t.Fatalf("existing dir: %v", err)
	}
	if err := os.WriteFile(filepath.Join(e.home, "file.txt"), []byte("12345"), 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := e.fs.MakeDir(ctx, connect.NewRequest(&fspb.MakeDirRequest{Path: "file.txt"})); codeOf(err) != connect.CodeInvalidArgument {
		t.Fatalf("file in the way: %v", err)
	}
	if _, err := e.fs.MakeDir(ctx, connect.NewRequest(&fspb.MakeDirRequest{Path: "file.txt/sub"})); codeOf(err) != connect.CodeInvalidArgument {
		t.Fatalf("file as a parent: %v", err)
	}

	// Stat.
	st, err := e.fs.Stat(ctx, connect.NewRequest(&fspb.StatRequest{Path: filepath.Join(e.home, "file.txt")}))
	if err != nil {
		t.Fatal(err)
	}
	if st.Msg.Entry.Size != 5 || st.Msg.Entry.Type != fspb.FileType_FILE_TYPE_FILE || st.Msg.Entry.Mode != 0o644 || st.Msg.Entry.ModifiedTime == nil {
		t.Fatalf("stat %v", st.Msg.Entry)
	}
	if _, err := e.fs.Stat(ctx, connect.NewRequest(&fspb.StatRequest{Path: "/no/such"})); codeOf(err) != connect.CodeNotFound {
		t.Fatalf("stat missing: %v", err)
	}
	// Symlinks are reported as E2B's envd does: the resolved target, with the target's type
	// and permission bits; a dangling link names itself, with type unspecified and mode 0.
	if err := os.Chmod(filepath.Join(e.home, "file.txt"), 0o640); err != nil {
		t.Fatal(err)
	}
	for _, l := range []struct{ name, target string }{{"link", "file.txt"}, {"dlink", "a"}, {"dangling", "nowhere"}} {
		if err := os.Symlink(l.target, filepath.Join(e.home, l.name)); err != nil {
			t.Fatal(err)
		}
	}
	for _, tc := range []struct {
		path, target string
		typ          fspb.FileType
		mode         uint32
	}{
		{"link", filepath.Join(e.home, "file.txt"), fspb.FileType_FILE_TYPE_FILE, 0o640},
		{"dlink", filepath.Join(e.home, "a"), fspb.FileType_FILE_TYPE_DIRECTORY, 0o755},
		{"dangling", filepath.Join(e.home, "dangling"), fspb.FileType_FILE_TYPE_UNSPECIFIED, 0},
	} {
		st, err = e.fs.Stat(ctx, connect.NewRequest(&fspb.StatRequest{Path: tc.path}))
		if err != nil {
			t.Fatal(err)
		}
		en := st.Msg.Entry
		if en.Type != tc.typ || en.Mode != tc.mode || en.GetSymlinkTarget() != tc.target || en.Permissions != "Lrwxrwxrwx" {
			t.Fatalf("symlink %s: type %v mode %o target %q permissions %s; want %v %o %q Lrwxrwxrwx",
				tc.path, en.Type, en.Mode, en.GetSymlinkTarget(), en.Permissions, tc.typ, tc.mode, tc.target)
		}
	}

	// Move creates destination parents and returns the new entry.
	mv, err := e.fs.Move(ctx, connect.NewRequest(&fspb.MoveRequest{Source: "file.txt", Destination: "moved/here.txt"}))
	if err != nil || mv.Msg.Entry.Path != filepath.Join(e.home, "moved/here.txt") || mv.Msg.Entry.Size != 5 {
		t.Fatalf("move %v %v", mv, err)
	}
	if _, err := e.fs.Move(ctx, connect.NewRequest(&fspb.MoveRequest{Source: "file.txt", Destination: "x"})); codeOf(err) != connect.CodeNotFound {
		t.Fatalf("move missing: %v", err)
	}

	// Remove is recursive and tolerates a missing path.
	if _, err := e.fs.Remove(ctx, connect.NewRequest(&fspb.RemoveRequest{Path: "a"})); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(e.home, "a")); !os.IsNotExist(err) {
		t.Fatalf("not removed: %v", err)
	}
	if _, err := e.fs.Remove(ctx, connect.NewRequest(&fspb.RemoveRequest{Path: "a"})); err != nil {
		t.Fatalf("remove missing: %v", err)
	}
}

func TestListDir(t *testing.T) {
	e := newEnv(t, envOpts{})
	ctx := t.Context()
	for _, p := range []string{"t/x/y/z.txt", "t/a.txt", "t/x/b.txt"} {
		full := filepath.Join(e.home, p)
		_ = os.MkdirAll(filepath.Dir(full), 0o755)
		_ = os.WriteFile(full, []byte(p), 0o644)
	}
	_ = os.Symlink(filepath.Join(e.home, "t/x"), filepath.Join(e.home, "t/lx"))
	_ = os.Symlink(filepath.Join(e.home, "t"), filepath.Join(e.home, "tl"))

	list := func(path string, depth uint32) ([]string, error) {
		r, err := e.fs.ListDir(ctx, connect.NewRequest(&fspb.ListDirRequest{Path: path, Depth: depth}))
		if err != nil {
			return nil, err
		}
		var out []string
		for _, en := range r.Msg.Entries {
			out = append(out, strings.TrimPrefix(en.Path, e.home+"/"))
		}
		return out, nil
	}
	got, err := list("t", 0)
	if err != nil || !slices.Equal(got, []string{"t/a.txt", "t/lx", "t/x"}) {
		t.Fatalf("depth 0 (=1): %v %v", got, err)
	}
	got, _ = list("t", 2)
	if !slices.Equal(got, []string{"t/a.txt", "t/lx", "t/x", "t/x/b.txt", "t/x/y"}) {
		t.Fatalf("depth 2: %v", got)
	}
	got, _ = list("t", 10)
	if !slices.Equal(got, []string{"t/a.txt", "t/lx", "t/x", "t/x/b.txt", "t/x/y", "t/x/y/z.txt"}) {
		t.Fatalf("depth 10: %v", got)
	}
	// A symlink to a directory is listed through, with paths under the requested name.
	got, _ = list("tl", 1)
	if !slices.Equal(got, []string{"tl/a.txt", "tl/lx", "tl/x"}) {
		t.Fatalf("through symlink: %v", got)
	}
	if _, err := list("t/a.txt", 1); codeOf(err) != connect.CodeInvalidArgument {
		t.Fatalf("list a file: %v", err)
	}
	if _, err := list("nope", 1); codeOf(err) != connect.CodeNotFound {
		t.Fatalf("list missing: %v", err)
	}
}

func TestWatchDir(t *testing.T) {
	e := newEnv(t, envOpts{})
	dir := filepath.Join(e.home, "w")
	_ = os.MkdirAll(filepath.Join(dir, "sub"), 0o755)
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	req := connect.NewRequest(&fspb.WatchDirRequest{Path: "w", Recursive: true, IncludeEntry: true})
	req.Header().Set("Keepalive-Ping-Interval", "1")
	s, err := e.fs.WatchDir(ctx, req)
	if err != nil {
		t.Fatal(err)
	}
	if !s.Receive() || s.Msg().GetStart() == nil {
		t.Fatalf("first message is not start: %v %v", s.Msg(), s.Err())
	}
	_ = os.WriteFile(filepath.Join(dir, "f.txt"), []byte("1"), 0o644)
	_ = os.WriteFile(filepath.Join(dir, "sub", "deep.txt"), []byte("1"), 0o644)
	_ = os.Mkdir(filepath.Join(dir, "newdir"), 0o755)
	time.Sleep(50 * time.Millisecond)
	_ = os.WriteFile(filepath.Join(dir, "newdir", "inner.txt"), []byte("1"), 0o644)
	_ = os.Rename(filepath.Join(dir, "f.txt"), filepath.Join(dir, "g.txt"))
	_ = os.Chmod(filepath.Join(dir, "g.txt"), 0o600)
	_ = os.Remove(filepath.Join(dir, "g.txt"))

	want := map[string]bool{
		"CREATE f.txt": false, "WRITE f.txt": false, "CREATE sub/deep.txt": false, "CREATE newdir": false,
		"CREATE newdir/inner.txt": false, "RENAME f.txt": false, "CHMOD g.txt": false, "REMOVE g.txt": false,
	}
	keepalive := false
	missing := func() []string {
		var m []string
		for k, v := range want {
			if !v {
				m = append(m, k)
			}
		}
		return m
	}
	for (len(missing()) > 0 || !keepalive) && s.Receive() {
		msg := s.Msg()
		if msg.GetKeepalive() != nil {
			keepalive = true
			continue
		}
		ev := msg.GetFilesystem()
		key := strings.TrimPrefix(ev.Type.String(), "EVENT_TYPE_") + " " + ev.Name
		want[key] = true
		if key == "CREATE f.txt" && (ev.Entry == nil || ev.Entry.Name != "f.txt") {
			t.Errorf("includeEntry: %v", ev)
		}
	}
	if m := missing(); len(m) > 0 {
		t.Fatalf("missing events %v (err %v)", m, s.Err())
	}
	cancel()
	s.Close()

	// Bad paths.
	for path, code := range map[string]connect.Code{"nope": connect.CodeNotFound, "w/sub/deep.txt": connect.CodeInvalidArgument} {
		s, err := e.fs.WatchDir(t.Context(), connect.NewRequest(&fspb.WatchDirRequest{Path: path}))
		if err == nil {
			s.Receive()
			err = s.Err()
		}
		if codeOf(err) != code {
			t.Errorf("watch %s: %v", path, err)
		}
	}
}

func TestPolledWatcher(t *testing.T) {
	e := newEnv(t, envOpts{})
	ctx := t.Context()
	_ = os.MkdirAll(filepath.Join(e.home, "pw"), 0o755)
	cw, err := e.fs.CreateWatcher(ctx, connect.NewRequest(&fspb.CreateWatcherRequest{Path: "pw"}))
	if err != nil {
		t.Fatal(err)
	}
	id := cw.Msg.WatcherId
	_ = os.WriteFile(filepath.Join(e.home, "pw", "x"), []byte("1"), 0o644)
	var names []string
	for i := 0; i < 100 && len(names) == 0; i++ {
		time.Sleep(20 * time.Millisecond)
		ev, err := e.fs.GetWatcherEvents(ctx, connect.NewRequest(&fspb.GetWatcherEventsRequest{WatcherId: id}))
		if err != nil {
			t.Fatal(err)
		}
		for _, x := range ev.Msg.Events {
			names = append(names, x.Name)
		}
	}
	if !slices.Contains(names, "x") {
		t.Fatalf("events %v", names)
	}
	if _, err := e.fs.RemoveWatcher(ctx, connect.NewRequest(&fspb.RemoveWatcherRequest{WatcherId: id})); err != nil {
		t.Fatal(err)
	}
	if _, err := e.fs.GetWatcherEvents(ctx, connect.NewRequest(&fspb.GetWatcherEventsRequest{WatcherId: id})); codeOf(err) != connect.CodeNotFound {
		t.Fatalf("removed watcher: %v", err)
	}
	if _, err := e.fs.RemoveWatcher(ctx, connect.NewRequest(&fspb.RemoveWatcherRequest{WatcherId: id})); codeOf(err) != connect.CodeNotFound {
		t.Fatalf("remove twice: %v", err)
	}
	if _, err := e.fs.CreateWatcher(ctx, connect.NewRequest(&fspb.CreateWatcherRequest{Path: "nope"})); codeOf(err) != connect.CodeNotFound {
		t.Fatalf("create on missing dir: %v", err)
	}
}

func TestFilesystemUnknownUser(t *testing.T) {
	e := newEnv(t, envOpts{})
	req := connect.NewRequest(&fspb.StatRequest{Path: "/"})
	req.Header().Set("Authorization", "Basic Z2hvc3Q6") // ghost:
	if _, err := e.fs.Stat(t.Context(), req); codeOf(err) != connect.CodeUnauthenticated || !strings.Contains(err.Error(), "invalid username: 'ghost'") {
		t.Fatalf("%v", err)
	}
}
