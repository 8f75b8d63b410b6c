package main

import (
	"encoding/json"
	"strings"
	"testing"

	"github.com/aenv-dev/aenv/internal/catalog"
	"github.com/aenv-dev/aenv/internal/sandbox"
	"github.com/aenv-dev/aenv/internal/sandbox/mock"
	"github.com/aenv-dev/aenv/internal/server/api"
)

// snapshotNode is node() over a mock backend that can snapshot (the real server,
// orchestrator and catalog; the mock copies files between captures).
func snapshotNode(t *testing.T) (string, *catalog.Catalog) {
	t.Helper()
	return mockNodeWith(t, mock.New(mock.Options{Capabilities: sandbox.Capabilities{Snapshots: true}}), nil)
}

func mustAenv(t *testing.T, url string, args ...string) string {
	t.Helper()
	out, stderr, err := aenv(t, url, args...)
	if err != nil {
		t.Fatalf("aenv %s: %v\n%s", strings.Join(args, " "), err, stderr)
	}
	return out
}

func TestSnapshotAndForkCLI(t *testing.T) {
	url, cat := snapshotNode(t)
	id := strings.TrimSpace(mustAenv(t, url, "start", "-d"))

	// create: JSON when not on a terminal (tests write to a buffer), a table with -o table.
	var snap api.SnapshotInfo
	if err := json.Unmarshal([]byte(mustAenv(t, url, "snapshot", "create", id, "--name", "step-1")), &snap); err != nil {
		t.Fatal(err)
	}
	if snap.SnapshotID == "" || len(snap.Names) != 1 || snap.Names[0] != "step-1" || strOrEmpty(snap.SourceSandboxID) != id {
		t.Fatalf("snapshot create = %+v", snap)
	}
	table := mustAenv(t, url, "snapshot", "create", id, "-o", "table")
	if lines := strings.Split(strings.TrimSpace(table), "\n"); len(lines) != 2 || !strings.HasPrefix(lines[0], "ID") ||
		!strings.Contains(lines[1], id) {
		t.Fatalf("snapshot create -o table:\n%s", table)
	}

	// ls: filters by sandbox and name; JSON and table.
	var listed []api.SnapshotInfo
	if err := json.Unmarshal([]byte(mustAenv(t, url, "snapshot", "ls", "--sandbox", id)), &listed); err != nil {
		t.Fatal(err)
	}
	if len(listed) != 2 {
		t.Fatalf("snapshot ls --sandbox: %+v", listed)
	}
	if err := json.Unmarshal([]byte(mustAenv(t, url, "snapshot", "ls", "--name", "step-1")), &listed); err != nil {
		t.Fatal(err)
	}
	if len(listed) != 1 || listed[0].SnapshotID != snap.SnapshotID {
		t.Fatalf("snapshot ls --name: %+v", listed)
	}
	if out := mustAenv(t, url, "snapshot", "ls", "--sandbox", "nobody"); strings.TrimSpace(out) != "[]" {
		t.Fatalf("snapshot ls of a sandbox without snapshots: %q", out)
	}
	table = mustAenv(t, url, "snapshot", "ls", "-o", "table")
	if !strings.HasPrefix(table, "ID") || strings.Count(table, "\n") != 3 || !strings.Contains(table, "step-1") {
		t.Fatalf("snapshot ls -o table:\n%s", table)
	}

	// fork: one result per child, in order, each a new sandbox; piped, one JSON object per
	// line, as the docs say ("one line per child").
	var forks []api.SandboxForkResult
	for _, line := range strings.Split(strings.TrimSuffix(mustAenv(t, url, "fork", id, "-n", "3", "--timeout", "60"), "\n"), "\n") {
		var f api.SandboxForkResult
		if err := json.Unmarshal([]byte(line), &f); err != nil {
			t.Fatalf("fork output line %q: %v", line, err)
		}
		forks = append(forks, f)
	}
	seen := map[string]bool{id: true}
	for i, f := range forks {
		if f.Sandbox == nil || seen[f.Sandbox.SandboxID] {
			t.Fatalf("fork %d: %+v", i, f)
		}
		seen[f.Sandbox.SandboxID] = true
	}
	if len(forks) != 3 {
		t.Fatalf("fork -n 3 gave %d results", len(forks))
	}
	table = mustAenv(t, url, "fork", id, "--count", "2", "--timeout", "2m", "-o", "table")
	if !strings.HasPrefix(table, "#") || strings.Count(table, "\n") != 3 {
		t.Fatalf("fork -o table:\n%s", table)
	}

	// rm: by name; a second rm and an rm of a template are refused.
	if stdout, _, err := aenv(t, url, "snapshot", "rm", "step-1"); err != nil || !strings.Contains(stdout, snap.SnapshotID) {
		t.Fatalf("snapshot rm: %v %s", err, stdout)
	}
	if _, err := cat.Templates().Get(snap.SnapshotID); err == nil {
		t.Fatal("snapshot still in the catalog after rm")
	}
	if _, err := cat.Templates().Get("base"); err != nil {
		t.Fatal(err)
	}

	bad := []struct {
		args []string
		want string
	}{
		{[]string{"snapshot", "rm", "step-1"}, "no snapshot"},
		{[]string{"snapshot", "rm", "base"}, "aenv template rm"},
		{[]string{"snapshot", "create", "nope"}, "404"},
		{[]string{"snapshot", "ls", "-o", "yaml"}, "table or json"},
		{[]string{"fork", id, "-n", "0"}, "1 to 100"},
		{[]string{"fork", id, "-n", "101"}, "1 to 100"},
		{[]string{"fork", id, "--timeout", "0"}, "positive"},
		{[]string{"fork", id, "--timeout", "soon"}, "duration"},
		{[]string{"fork", "nope"}, "404"},
	}
	for _, tc := range bad {
		t.Run(strings.Join(tc.args, " "), func(t *testing.T) {
			_, _, err := aenv(t, url, tc.args...)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("err = %v, want it to mention %q", err, tc.want)
			}
		})
	}
	if _, err := cat.Templates().Get("base"); err != nil {
		t.Fatalf("base template gone after `snapshot rm base`: %v", err)
	}
}

func TestSnapshotCLIWhereUnsupported(t *testing.T) {
	url, _ := mockNode(t) // the mock without snapshot support answers 501
	id := strings.TrimSpace(mustAenv(t, url, "start", "-d"))
	for _, args := range [][]string{{"snapshot", "create", id}, {"fork", id, "-n", "2"}} {
		_, _, err := aenv(t, url, args...)
		if err == nil || !strings.Contains(err.Error(), "501") || !strings.Contains(err.Error(), "cannot be snapshotted") {
			t.Errorf("aenv %s: %v", strings.Join(args, " "), err)
		}
	}
}

func TestParseTimeoutSeconds(t *testing.T) {
	tests := []struct {
		in   string
		want int32
		ok   bool
	}{
		{"60", 60, true},
		{"10m", 600, true},
		{"1.5s", 2, true},
		{"0", 0, false},
		{"-5", 0, false},
		{"500ms", 0, false},
		{"soon", 0, false},
	}
	for _, tc := range tests {
		got, err := parseTimeoutSeconds(tc.in)
		if (err == nil) != tc.ok || got != tc.want {
			t.Errorf("parseTimeoutSeconds(%q) = %d, %v; want %d ok=%v", tc.in, got, err, tc.want, tc.ok)
		}
	}
}
