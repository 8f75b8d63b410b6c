package orchestrator

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/aenv-dev/aenv/internal/sandbox"
)

func TestLogStoreQuery(t *testing.T) {
	s := newLogStore(t.TempDir())
	t0 := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	levels := []string{LevelDebug, LevelInfo, LevelWarn, LevelError}
	for i := range 8 {
		if err := s.add("sb", LogEntry{Time: t0.Add(time.Duration(i) * time.Second), Level: levels[i%4], Message: fmt.Sprintf("line %d", i)}); err != nil {
			t.Fatal(err)
		}
	}
	msgs := func(es []LogEntry) string {
		out := ""
		for _, e := range es {
			out += e.Message[5:]
		}
		return out
	}
	tests := []struct {
		name string
		q    LogQuery
		want string
	}{
		{"forward all", LogQuery{Forward: true}, "01234567"},
		{"forward from cursor", LogQuery{Forward: true, Cursor: t0.Add(5 * time.Second)}, "567"},
		{"forward limit", LogQuery{Forward: true, Limit: 3}, "012"},
		{"backward all", LogQuery{}, "76543210"},
		{"backward from cursor", LogQuery{Cursor: t0.Add(2 * time.Second)}, "210"},
		{"backward limit", LogQuery{Limit: 2}, "76"},
		{"min level", LogQuery{Forward: true, MinLevel: LevelWarn}, "2367"},
		{"search", LogQuery{Forward: true, Search: "e 4"}, "4"},
		{"search is case-sensitive", LogQuery{Forward: true, Search: "LINE"}, ""},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			if got := msgs(s.query("sb", tc.q)); got != tc.want {
				t.Fatalf("query = %q, want %q", got, tc.want)
			}
		})
	}
	if got := s.query("other", LogQuery{Forward: true}); got == nil || len(got) != 0 {
		t.Fatalf("unknown sandbox = %#v, want an empty list", got)
	}
}

// Entries and the file are bounded; a new store (a restarted node) reads the file; drop
// removes it.
func TestLogStoreBoundsAndPersistence(t *testing.T) {
	dir := t.TempDir()
	s := newLogStore(dir)
	long := string(make([]byte, 1000))
	n := maxLogEntries + 500
	for i := range n {
		if err := s.add("sb", LogEntry{Time: time.Unix(int64(i), 0), Level: LevelInfo, Message: fmt.Sprint(i, long)}); err != nil {
			t.Fatal(err)
		}
	}
	fi, err := os.Stat(filepath.Join(dir, "sb.jsonl"))
	if err != nil || fi.Size() > maxLogFileBytes {
		t.Fatalf("log file: %v, size %d > %d", err, fi.Size(), maxLogFileBytes)
	}
	all := s.query("sb", LogQuery{Forward: true, Limit: MaxLogLimit})
	if len(all) != MaxLogLimit || all[0].Time.Unix() != int64(n-maxLogEntries) {
		t.Fatalf("kept %d entries from %v, want the newest %d", len(all), all[0].Time.Unix(), maxLogEntries)
	}

	re := newLogStore(dir)
	late := re.buf("sb") // a writer that started before the drop
	got := re.query("sb", LogQuery{Limit: 1})
	if len(got) != 1 || got[0].Time.Unix() != int64(n-1) {
		t.Fatalf("after reload newest = %+v", got)
	}
	if err := re.drop("sb"); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(dir, "sb.jsonl")); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("log file after drop: %v", err)
	}
	if err := re.addTo("sb", late, LogEntry{Time: time.Now(), Message: "late"}); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(dir, "sb.jsonl")); !errors.Is(err, os.ErrNotExist) {
		t.Fatal("a write after drop re-created the log file")
	}
}

// A sandbox's logs hold its lifecycle events and its start command's output, stay while
// it is paused and after a restart, and go with it.
func TestSandboxLogs(t *testing.T) {
	ctx := context.Background()
	h := newServeHarness(t, snapModes[0].opts, false)
	sb := h.create(CreateRequest{TemplateID: "web", Timeout: time.Minute})
	want := map[string]string{
		"sandbox started":       LevelInfo,
		"start command started": LevelInfo,
		"out of -l -c serve":    LevelInfo,
		"err line":              LevelWarn,
		"start command ended":   LevelInfo,
	}
	eventually(t, "start command output in the logs", func() bool {
		es, err := h.o.Logs(ctx, sb.ID, LogQuery{Forward: true})
		return err == nil && len(es) >= len(want)
	})
	es, _ := h.o.Logs(ctx, sb.ID, LogQuery{Forward: true})
	for _, e := range es {
		if lvl, ok := want[e.Message]; ok && lvl == e.Level {
			delete(want, e.Message)
		}
	}
	if len(want) != 0 {
		t.Fatalf("missing entries %v in %+v", want, es)
	}

	if err := h.o.Pause(ctx, sb.ID, sandbox.PauseOptions{KeepMemory: true}); err != nil {
		t.Fatal(err)
	}
	h.restart()
	es, err := h.o.Logs(ctx, sb.ID, LogQuery{Limit: 1})
	if err != nil || len(es) != 1 || es[0].Message != "sandbox paused" {
		t.Fatalf("newest entry of the paused sandbox after restart = %+v, %v", es, err)
	}
	if _, _, err := h.o.Connect(ctx, sb.ID, ConnectOptions{Timeout: time.Minute}); err != nil {
		t.Fatal(err)
	}
	if es, _ := h.o.Logs(ctx, sb.ID, LogQuery{Limit: 1}); len(es) != 1 || es[0].Message != "sandbox resumed" || es[0].Fields["coldBoot"] != "false" {
		t.Fatalf("newest entry after resume = %+v", es)
	}
	if _, err := h.o.Logs(ctx, sb.ID, LogQuery{MinLevel: "loud"}); !errors.Is(err, ErrInvalid) {
		t.Fatalf("bad level: %v", err)
	}
	if err := h.o.Kill(ctx, sb.ID); err != nil {
		t.Fatal(err)
	}
	if _, err := h.o.Logs(ctx, sb.ID, LogQuery{}); !errors.Is(err, ErrNotFound) {
		t.Fatalf("logs of a killed sandbox: %v", err)
	}
	if _, err := os.Stat(filepath.Join(h.o.logs.dir, sb.ID+".jsonl")); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("log file of a killed sandbox: %v", err)
	}
}
