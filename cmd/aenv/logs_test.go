package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/aenv-dev/aenv/internal/catalog"
	"github.com/aenv-dev/aenv/internal/server/api"
)

// logsNode is a node whose sandbox ran the mock's start command (one stdout line, one
// stderr line, exit 0); it returns the node URL, a client and the sandbox's id once its
// start command's end is in the logs.
func logsNode(t *testing.T) (string, *client, string) {
	t.Helper()
	url, cat := mockNode(t)
	if err := cat.Templates().Put(catalog.Template{ID: "web", Kind: catalog.KindTemplate, RootFSDir: t.TempDir(),
		StartCmd: "serve"}); err != nil {
		t.Fatal(err)
	}
	out, _, err := aenv(t, url, "start", "-d", "web")
	if err != nil {
		t.Fatal(err)
	}
	id := strings.TrimSpace(out)
	c, err := (&globals{url: url, apiKey: testKey}).client()
	if err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(10 * time.Second)
	for !strings.Contains(fmt.Sprint(readAll(t, c, id, logsOpts{pageSize: 1000})), "start command ended") {
		if time.Now().After(deadline) {
			t.Fatal("the start command's end never reached the logs")
		}
		time.Sleep(10 * time.Millisecond)
	}
	return url, c, id
}

func readAll(t *testing.T, c *client, id string, o logsOpts) []api.SandboxLogEntry {
	t.Helper()
	var got []api.SandboxLogEntry
	if err := c.readLogs(t.Context(), id, o, func(e api.SandboxLogEntry) error { got = append(got, e); return nil }); err != nil {
		t.Fatal(err)
	}
	return got
}

func messages(es []api.SandboxLogEntry) []string {
	out := make([]string, len(es))
	for i, e := range es {
		out[i] = e.Message
	}
	return out
}

func TestLogsCLI(t *testing.T) {
	url, _, id := logsNode(t)

	out, _, err := aenv(t, url, "logs", id)
	if err != nil {
		t.Fatal(err)
	}
	var msgs []string
	for _, line := range strings.Split(strings.TrimSpace(out), "\n") {
		var e api.SandboxLogEntry
		if err := json.Unmarshal([]byte(line), &e); err != nil || e.Timestamp.IsZero() || e.Level == "" {
			t.Fatalf("piped output line %q is not a log entry: %v", line, err)
		}
		msgs = append(msgs, e.Message)
	}
	for _, want := range []string{"sandbox started", "start command started", "out of -l -c serve", "err line", "start command ended"} {
		if !slices.Contains(msgs, want) {
			t.Errorf("logs lack %q: %q", want, msgs)
		}
	}

	out, _, err = aenv(t, url, "logs", id, "-o", "table")
	if err != nil {
		t.Fatal(err)
	}
	line := regexp.MustCompile(`(?m)^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}\S* (INFO |WARN |ERROR) \S`)
	if n := len(line.FindAllString(out, -1)); n != len(msgs) {
		t.Fatalf("table output has %d well-formed lines, want %d:\n%s", n, len(msgs), out)
	}
	if !regexp.MustCompile(`(?m) WARN  err line$`).MatchString(out) || !strings.Contains(out, "start command ended exitCode=0") {
		t.Fatalf("table output:\n%s", out)
	}

	out, _, err = aenv(t, url, "logs", id, "--level", "warn", "-o", "json")
	if err != nil || strings.Count(out, "\n") != 1 || !strings.Contains(out, `"err line"`) {
		t.Fatalf("--level warn: %v\n%s", err, out)
	}
	if out, _, err := aenv(t, url, "logs", id, "--since", "1h"); err != nil || strings.Count(out, "\n") != len(msgs) {
		t.Fatalf("--since 1h: %v\n%s", err, out)
	}

	for _, tt := range []struct {
		args []string
		want string
	}{
		{[]string{"logs", "nosuchsandbox"}, "sandbox nosuchsandbox not found"},
		{[]string{"logs", id, "--level", "loud"}, "--level"},
		{[]string{"logs", id, "--since", "-5m"}, "--since"},
		{[]string{"logs", id, "-o", "yaml"}, "table or json"},
		{[]string{"logs"}, "arg"},
	} {
		if _, _, err := aenv(t, url, tt.args...); err == nil || !strings.Contains(err.Error(), tt.want) {
			t.Errorf("aenv %q: %v, want an error about %q", tt.args, err, tt.want)
		}
	}
}

// Entries sharing one millisecond across pages are neither repeated nor lost, and a page
// entirely within one millisecond does not loop.
func TestReadLogsSameMillisecond(t *testing.T) {
	t0 := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	at := func(offs ...time.Duration) []api.SandboxLogEntry {
		var es []api.SandboxLogEntry
		for i, off := range offs {
			es = append(es, api.SandboxLogEntry{Timestamp: t0.Add(off), Level: "info", Message: fmt.Sprint(i)})
		}
		return es
	}
	ms := time.Millisecond
	entries := at(0, ms, ms+100*time.Microsecond, 2*ms, 2*ms+1, 3*ms)
	requests := 0
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		requests++
		var cursor, limit int64
		fmt.Sscan(r.URL.Query().Get("cursor"), &cursor)
		fmt.Sscan(r.URL.Query().Get("limit"), &limit)
		page := []api.SandboxLogEntry{}
		for _, e := range entries {
			if e.Timestamp.UnixMilli() >= cursor && int64(len(page)) < limit {
				page = append(page, e)
			}
		}
		w.Header().Set("Content-Type", "application/json")
		json.NewEncoder(w).Encode(api.SandboxLogsV2Response{Logs: page})
	}))
	t.Cleanup(srv.Close)
	c, err := (&globals{url: srv.URL, apiKey: testKey}).client()
	if err != nil {
		t.Fatal(err)
	}
	for _, size := range []int32{2, 3, 1000} {
		got := readAll(t, c, "sb", logsOpts{pageSize: size})
		if want := []string{"0", "1", "2", "3", "4", "5"}; !slices.Equal(messages(got), want) {
			t.Fatalf("page size %d: %q, want %q", size, messages(got), want)
		}
	}
	// More entries in one millisecond than a page holds cannot all be reached through a
	// millisecond cursor: the rest of that millisecond is given up, not looped on.
	entries = at(0, 2*ms, 2*ms+1, 2*ms+2, 2*ms+3, 3*ms)
	requests = 0
	got := readAll(t, c, "sb", logsOpts{pageSize: 3, since: t0.Add(2 * ms)})
	if want := []string{"1", "2", "3", "5"}; !slices.Equal(messages(got), want) || requests > 3 {
		t.Fatalf("page size 3 from ms 2: %q after %d requests, want %q", messages(got), requests, want)
	}
}

// Following prints new entries as they come, each once, and ends when the sandbox goes.
func TestReadLogsFollow(t *testing.T) {
	url, c, id := logsNode(t)
	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	defer cancel()
	got := make(chan api.SandboxLogEntry, 100)
	done := make(chan error, 1)
	go func() {
		done <- c.readLogs(ctx, id, logsOpts{follow: true, interval: 10 * time.Millisecond, pageSize: 1000},
			func(e api.SandboxLogEntry) error { got <- e; return nil })
	}()
	var seen []string
	wait := func(msg string) {
		t.Helper()
		for !slices.Contains(seen, msg) {
			select {
			case e := <-got:
				seen = append(seen, e.Message)
			case <-ctx.Done():
				t.Fatalf("%q never followed; got %q", msg, seen)
			}
		}
	}
	wait("start command ended")
	if _, _, err := aenv(t, url, "pause", id); err != nil {
		t.Fatal(err)
	}
	wait("sandbox paused")
	if _, _, err := aenv(t, url, "kill", id); err != nil {
		t.Fatal(err)
	}
	if err := <-done; !errors.Is(err, errSandboxGone) {
		t.Fatalf("follow of a killed sandbox ended with %v", err)
	}
	close(got)
	for e := range got {
		seen = append(seen, e.Message)
	}
	count := map[string]int{}
	for _, m := range seen {
		if count[m]++; count[m] == 2 {
			t.Errorf("%q followed more than once: %q", m, seen)
		}
	}
}
