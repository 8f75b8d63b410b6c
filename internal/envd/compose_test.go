package envd_test

import (
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"github.com/aenv-dev/aenv/internal/envd/files"
)

// POST /files/compose concatenates the sources in order into the destination (owned by the
// user), deletes the sources, and answers E2B's {path, name, type}; bad requests change nothing.
func TestFilesCompose(t *testing.T) {
	e := newEnv(t, envOpts{token: "tok"})
	auth := map[string]string{"Content-Type": "application/json", "X-Access-Token": "tok"}
	for i, p := range []string{"part1", "part2", "sub/part3"} {
		full := filepath.Join(e.home, p)
		os.MkdirAll(filepath.Dir(full), 0o755)
		if err := os.WriteFile(full, []byte(strings.Repeat(string(rune('a'+i)), 100000)), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	body := `{"source_paths":["part1","~/sub/part3","` + filepath.Join(e.home, "part2") + `"],"destination":"out/all.bin"}`

	resp, b := e.do("POST", "/files/compose", strings.NewReader(body), map[string]string{"Content-Type": "application/json"})
	wantJSONError(t, resp, b, 401)
	resp, b = e.do("POST", "/files/compose", strings.NewReader(`{"source_paths":["part1","missing"],"destination":"x"}`), auth)
	wantJSONError(t, resp, b, 404)
	resp, b = e.do("POST", "/files/compose", strings.NewReader(`{"source_paths":["part1"],"destination":"part1"}`), auth)
	wantJSONError(t, resp, b, 400)
	resp, b = e.do("POST", "/files/compose", strings.NewReader(`{"source_paths":["sub"],"destination":"x"}`), auth)
	wantJSONError(t, resp, b, 400)
	resp, b = e.do("POST", "/files/compose", strings.NewReader(`{"source_paths":[],"destination":"x"}`), auth)
	wantJSONError(t, resp, b, 400)
	if _, err := os.Stat(filepath.Join(e.home, "part1")); err != nil {
		t.Fatalf("a refused compose removed a source: %v", err)
	}

	resp, b = e.do("POST", "/files/compose", strings.NewReader(body), auth)
	if resp.StatusCode != 200 {
		t.Fatalf("%d %s", resp.StatusCode, b)
	}
	var got files.WrittenFile
	dest := filepath.Join(e.home, "out/all.bin")
	if err := json.Unmarshal(b, &got); err != nil || got.Path != dest || got.Name != "all.bin" || got.Type != "file" {
		t.Fatalf("response %s (%v)", b, err)
	}
	data, err := os.ReadFile(dest)
	want := strings.Repeat("a", 100000) + strings.Repeat("c", 100000) + strings.Repeat("b", 100000)
	if err != nil || string(data) != want {
		t.Fatalf("composed %d bytes (%v), want a, c, b in order", len(data), err)
	}
	for _, p := range []string{"part1", "part2", "sub/part3"} {
		if _, err := os.Stat(filepath.Join(e.home, p)); !os.IsNotExist(err) {
			t.Fatalf("source %s not deleted: %v", p, err)
		}
	}
	if os.Geteuid() == 0 {
		fi, _ := os.Stat(dest)
		if st := fi.Sys().(*syscall.Stat_t); st.Uid != 4242 {
			t.Fatalf("destination owned by uid %d, want the user's 4242", st.Uid)
		}
	}
	ents, _ := os.ReadDir(filepath.Dir(dest))
	if len(ents) != 1 {
		t.Fatalf("temporary files left next to the destination: %v", ents)
	}
}
