package build

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

func TestStoreLogsOffsets(t *testing.T) {
	dir := t.TempDir()
	s, err := openStore(dir)
	if err != nil {
		t.Fatal(err)
	}
	if err := s.put(&Record{ID: "b1", TemplateID: "t", Status: StatusBuilding, CreatedAt: time.Now()}); err != nil {
		t.Fatal(err)
	}
	for i := range 5 {
		s.log("b1", "info", fmt.Sprintf("line %d", i))
	}
	tests := []struct {
		offset, limit int
		want          []string
	}{
		{0, 0, []string{"line 0", "line 1", "line 2", "line 3", "line 4"}},
		{3, 0, []string{"line 3", "line 4"}},
		{1, 2, []string{"line 1", "line 2"}},
		{5, 0, nil},
		{99, 0, nil},
		{-1, 1, []string{"line 0"}},
	}
	for _, tt := range tests {
		got := s.logsFrom("b1", tt.offset, tt.limit)
		var msgs []string
		for _, e := range got {
			msgs = append(msgs, e.Message)
		}
		if fmt.Sprint(msgs) != fmt.Sprint(tt.want) || got == nil {
			t.Errorf("logsFrom(%d, %d) = %v, want %v", tt.offset, tt.limit, msgs, tt.want)
		}
	}
	// Records and logs survive a reopen (the node restarting).
	s2, err := openStore(dir)
	if err != nil {
		t.Fatal(err)
	}
	if r, ok := s2.get("b1"); !ok || r.Status != StatusBuilding {
		t.Errorf("reopened record = %+v, %v", r, ok)
	}
	if got := s2.logsFrom("b1", 4, 0); len(got) != 1 || got[0].Message != "line 4" {
		t.Errorf("reopened logs = %+v", got)
	}
	// A torn record file is skipped, not fatal.
	os.WriteFile(filepath.Join(dir, "b2.json"), []byte("{"), 0o600)
	if _, err := openStore(dir); err != nil {
		t.Errorf("torn record: %v", err)
	}
}

func TestStoreLogLimits(t *testing.T) {
	s, err := openStore(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	s.log("b", "info", strings.Repeat("x", maxLogLine+10))
	if got := s.logsFrom("b", 0, 0); len(got[0].Message) > maxLogLine+4 {
		t.Errorf("long line kept %d bytes", len(got[0].Message))
	}
	for range maxLogEntries + 5 {
		s.log("b", "info", "y")
	}
	got := s.logsFrom("b", 0, 0)
	if len(got) != maxLogEntries+1 || got[maxLogEntries].Level != "warn" {
		t.Errorf("kept %d entries, last %+v", len(got), got[len(got)-1])
	}
}

type tarEntry struct {
	name, body, link string
	typ              byte
	mode             int64
}

func makeTar(t *testing.T, gz bool, entries ...tarEntry) []byte {
	t.Helper()
	var buf bytes.Buffer
	var w io.Writer = &buf
	var zw *gzip.Writer
	if gz {
		zw = gzip.NewWriter(&buf)
		w = zw
	}
	tw := tar.NewWriter(w)
	for _, e := range entries {
		typ := e.typ
		if typ == 0 {
			typ = tar.TypeReg
		}
		mode := e.mode
		if mode == 0 {
			mode = 0o644
		}
		if err := tw.WriteHeader(&tar.Header{Name: e.name, Typeflag: typ, Mode: mode, Size: int64(len(e.body)), Linkname: e.link, Uid: 501}); err != nil {
			t.Fatal(err)
		}
		tw.Write([]byte(e.body))
	}
	tw.Close()
	if zw != nil {
		zw.Close()
	}
	return buf.Bytes()
}

func TestRewriteCopy(t *testing.T) {
	upload := makeTar(t, true,
		tarEntry{name: "hello.txt", body: "hi"},
		tarEntry{name: "dir/", typ: tar.TypeDir, mode: 0o755},
		tarEntry{name: "dir/a.txt", body: "a"},
		tarEntry{name: "dir/sub/", typ: tar.TypeDir, mode: 0o755},
		tarEntry{name: "dir/sub/b.txt", body: "b"},
		tarEntry{name: "dir/l", typ: tar.TypeSymlink, link: "a.txt"},
		tarEntry{name: "dir/h", typ: tar.TypeLink, link: "dir/a.txt"},
	)
	tests := []struct {
		name string
		plan copyPlan
		want []string // "name uid mode"
		err  string
	}{
		{"file to path", copyPlan{src: "hello.txt", dest: "/app/h.txt", uid: 1000, gid: 1000},
			[]string{"app/h.txt 1000 644"}, ""},
		{"file into dir", copyPlan{src: "hello.txt", dest: "/app", destDir: true, uid: 0, gid: 0, mode: 0o600},
			[]string{"app/ 0 755", "app/hello.txt 0 600"}, ""},
		{"dir contents", copyPlan{src: "dir", dest: "/opt/d", uid: 7, gid: 7},
			[]string{"opt/d/ 7 755", "opt/d/a.txt 7 644", "opt/d/sub/ 7 755", "opt/d/sub/b.txt 7 644", "opt/d/l 7 644", "opt/d/h 7 644"}, ""},
		{"glob", copyPlan{src: "*.txt", dest: "/g", destDir: true},
			[]string{"g/ 0 755", "g/hello.txt 0 644"}, ""},
		{"no match", copyPlan{src: "nope", dest: "/x"}, nil, "no uploaded files match"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var out bytes.Buffer
			_, err := rewriteCopy(bytes.NewReader(upload), tt.plan, &out)
			if tt.err != "" {
				if err == nil || !strings.Contains(err.Error(), tt.err) {
					t.Fatalf("err = %v, want %q", err, tt.err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			tr := tar.NewReader(&out)
			var got []string
			for {
				h, err := tr.Next()
				if errors.Is(err, io.EOF) {
					break
				}
				if err != nil {
					t.Fatal(err)
				}
				got = append(got, fmt.Sprintf("%s %d %o", h.Name, h.Uid, h.Mode))
				if h.Typeflag == tar.TypeLink && h.Linkname != "opt/d/a.txt" {
					t.Errorf("hard link target %q", h.Linkname)
				}
			}
			if fmt.Sprint(got) != fmt.Sprint(tt.want) {
				t.Errorf("entries:\n got %v\nwant %v", got, tt.want)
			}
		})
	}
	// Hostile uploads are refused.
	for _, bad := range [][]byte{
		makeTar(t, false, tarEntry{name: "../etc/passwd", body: "x"}),
		makeTar(t, false, tarEntry{name: "/etc/passwd", body: "x"}),
		makeTar(t, false, tarEntry{name: "dev", typ: tar.TypeChar}),
	} {
		if _, err := rewriteCopy(bytes.NewReader(bad), copyPlan{src: ".", dest: "/x"}, io.Discard); err == nil {
			t.Error("hostile upload accepted")
		}
	}
}

func TestLookupOwner(t *testing.T) {
	passwd := []byte("root:x:0:0::/root:/bin/sh\nuser:x:1000:1001::/home/user:/bin/bash\n")
	group := []byte("root:x:0:\nusers:x:100:\n")
	tests := []struct {
		owner    string
		uid, gid int
		err      bool
	}{
		{"root", 0, 0, false},
		{"user", 1000, 1001, false},
		{"user:users", 1000, 100, false},
		{"1000", 1000, 1001, false},
		{"4242", 4242, 4242, false},
		{"user:7", 1000, 7, false},
		{"nobody", 0, 0, true},
		{"user:nogroup", 0, 0, true},
	}
	for _, tt := range tests {
		uid, gid, err := lookupOwner(tt.owner, passwd, group)
		if (err != nil) != tt.err || (!tt.err && (uid != tt.uid || gid != tt.gid)) {
			t.Errorf("lookupOwner(%q) = %d, %d, %v", tt.owner, uid, gid, err)
		}
	}
}

func TestFileStore(t *testing.T) {
	f, err := openFileStore(t.TempDir(), 1<<20)
	if err != nil {
		t.Fatal(err)
	}
	good := makeTar(t, true, tarEntry{name: "a", body: "a"})
	tests := []struct {
		name, hash string
		body       []byte
		want       error
	}{
		{"gzip tar", "abc123", good, nil},
		{"plain tar", "def", makeTar(t, false, tarEntry{name: "b", body: "b"}), nil},
		{"bad hash", "../x", good, ErrInvalidSpec},
		{"not a tar", "h1", []byte("hello world, not a tar at all"), ErrInvalidSpec},
		{"truncated", "h2", good[:len(good)/2], ErrInvalidSpec},
		{"too large", "h3", makeTar(t, false, tarEntry{name: "big", body: strings.Repeat("x", 1<<20)}), ErrTooLarge},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			err := f.Put(tt.hash, bytes.NewReader(tt.body))
			if !errors.Is(err, tt.want) || (tt.want != nil) == (err == nil) {
				t.Fatalf("Put = %v, want %v", err, tt.want)
			}
			present, _ := f.Present(tt.hash)
			if present != (tt.want == nil) {
				t.Errorf("present = %v after Put err %v", present, err)
			}
		})
	}
	ents, _ := os.ReadDir(f.dir)
	if len(ents) != 2 {
		t.Errorf("store holds %d files, want the 2 good uploads (no temp files left)", len(ents))
	}
}

func TestSpecValidate(t *testing.T) {
	ok := Spec{FromTemplate: "base", Steps: []Step{
		{Type: StepRun, Args: []string{"echo hi"}}, {Type: StepRun, Args: []string{"id", "root"}},
		{Type: StepEnv, Args: []string{"A", "1"}}, {Type: StepWorkdir, Args: []string{"/app"}},
		{Type: StepUser, Args: []string{"user"}}, {Type: StepCopy, Args: []string{"a", "/b", "", ""}, FilesHash: "ff"},
		{Type: StepExpose, Args: []string{"80", "53/udp"}}, {Type: StepLabel, Args: []string{"a", "b", "c d", ""}},
		{Type: StepDefaultUser},
	}}
	if err := ok.Validate(); err != nil {
		t.Fatal(err)
	}
	bad := []Spec{
		{},
		{FromImage: "a", FromTemplate: "b"},
		{FromTemplate: "b", Steps: []Step{{Type: "HEALTHCHECK"}}},
		{FromTemplate: "b", Steps: []Step{{Type: StepRun}}},
		{FromTemplate: "b", Steps: []Step{{Type: StepEnv, Args: []string{"A"}}}},
		{FromTemplate: "b", Steps: []Step{{Type: StepEnv, Args: []string{"1A", "x"}}}},
		{FromTemplate: "b", Steps: []Step{{Type: StepUser, Args: []string{"a b"}}}},
		{FromTemplate: "b", Steps: []Step{{Type: StepCopy, Args: []string{"a", "/b"}}}},
		{FromTemplate: "b", Steps: []Step{{Type: StepCopy, Args: []string{"a", "/b", "", "999"}, FilesHash: "x"}}},
		{FromTemplate: "b", Steps: []Step{{Type: StepCopy, Args: []string{"a", "/b"}, FilesHash: "../x"}}},
		{FromTemplate: "b", Steps: []Step{{Type: StepExpose}}},
		{FromTemplate: "b", Steps: []Step{{Type: StepExpose, Args: []string{"0"}}}},
		{FromTemplate: "b", Steps: []Step{{Type: StepExpose, Args: []string{"65536/tcp"}}}},
		{FromTemplate: "b", Steps: []Step{{Type: StepExpose, Args: []string{"http"}}}},
		{FromTemplate: "b", Steps: []Step{{Type: StepLabel, Args: []string{"a"}}}},
		{FromTemplate: "b", Steps: []Step{{Type: StepDefaultUser, Args: []string{"root"}}}},
	}
	for i, s := range bad {
		if err := s.Validate(); !errors.Is(err, ErrInvalidSpec) {
			t.Errorf("bad spec %d accepted: %v", i, err)
		}
	}
}
