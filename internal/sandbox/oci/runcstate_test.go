package oci

import (
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
)

func TestReadRuncStates(t *testing.T) {
	// A fake /proc: pid 10 runs (started at tick 500), pid 11 is a zombie, pid 12 a
	// process whose comm holds ") Z " to trip a naive parser.
	proc := t.TempDir()
	stat := func(pid, comm, state string, start string) {
		fields := append([]string{state}, strings.Fields(strings.Repeat("0 ", 18))...)
		fields = append(fields, start, "0", "0")
		line := pid + " (" + comm + ") " + strings.Join(fields, " ") + "\n"
		if err := os.MkdirAll(filepath.Join(proc, pid), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(proc, pid, "stat"), []byte(line), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	stat("10", "init", "S", "500")
	stat("11", "init", "Z", "600")
	stat("12", "x) Z (y", "R", "700")

	tests := []struct {
		name  string
		files map[string]string // container id -> state.json ("" for none)
		fifo  []string          // ids whose exec.fifo exists
		want  []containerState  // nil with ok false: not understood
		ok    bool
	}{
		{"running", map[string]string{"a": `{"id":"a","init_process_pid":10,"init_process_start":500}`}, nil,
			[]containerState{{ID: "a", Pid: 10, Status: "running"}}, true},
		{"created", map[string]string{"a": `{"id":"a","init_process_pid":10,"init_process_start":500}`}, []string{"a"},
			[]containerState{{ID: "a", Pid: 10, Status: "created"}}, true},
		{"recycled pid", map[string]string{"a": `{"id":"a","init_process_pid":10,"init_process_start":499}`}, nil,
			[]containerState{{ID: "a", Status: "stopped"}}, true},
		{"zombie", map[string]string{"a": `{"id":"a","init_process_pid":11,"init_process_start":600}`}, nil,
			[]containerState{{ID: "a", Status: "stopped"}}, true},
		{"odd comm", map[string]string{"a": `{"id":"a","init_process_pid":12,"init_process_start":700}`}, nil,
			[]containerState{{ID: "a", Pid: 12, Status: "running"}}, true},
		{"no process", map[string]string{"a": `{"id":"a","init_process_pid":99,"init_process_start":500}`}, nil,
			[]containerState{{ID: "a", Status: "stopped"}}, true},
		{"two", map[string]string{
			"a": `{"id":"a","init_process_pid":10,"init_process_start":500}`,
			"b": `{"id":"b","init_process_pid":99,"init_process_start":1}`}, nil,
			[]containerState{{ID: "a", Pid: 10, Status: "running"}, {ID: "b", Status: "stopped"}}, true},
		{"fields after the config", map[string]string{"a": `{"config":{"x":[1,{"y":"}"}]},"init_process_start":500,"id":"a","init_process_pid":10}`}, nil,
			[]containerState{{ID: "a", Pid: 10, Status: "running"}}, true},
		// Decoding stops at the fields it needs (runc writes the file whole, by rename).
		{"config not read", map[string]string{"a": `{"id":"a","init_process_pid":10,"init_process_start":500,"config":{`}, nil,
			[]containerState{{ID: "a", Pid: 10, Status: "running"}}, true},
		{"null pid", map[string]string{"a": `{"id":"a","init_process_pid":null,"init_process_start":500}`}, nil, nil, false},
		{"not an object", map[string]string{"a": `[1]`}, nil, nil, false},
		{"no state file", map[string]string{"a": ""}, nil, nil, false},
		{"garbage", map[string]string{"a": `{"id":`}, nil, nil, false},
		{"no start time", map[string]string{"a": `{"id":"a","init_process_pid":10}`}, nil, nil, false},
		{"other id", map[string]string{"a": `{"id":"b","init_process_pid":10,"init_process_start":500}`}, nil, nil, false},
		{"empty root", map[string]string{}, nil, nil, true},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			root := t.TempDir()
			for id, content := range tc.files {
				dir := filepath.Join(root, id)
				if err := os.Mkdir(dir, 0o700); err != nil {
					t.Fatal(err)
				}
				if content != "" {
					if err := os.WriteFile(filepath.Join(dir, "state.json"), []byte(content), 0o600); err != nil {
						t.Fatal(err)
					}
				}
				if slices.Contains(tc.fifo, id) {
					if err := os.WriteFile(filepath.Join(dir, "exec.fifo"), nil, 0o600); err != nil {
						t.Fatal(err)
					}
				}
			}
			got, ok := readRuncStates(root, proc)
			if ok != tc.ok || !slices.Equal(got, tc.want) {
				t.Fatalf("readRuncStates = %+v, %v; want %+v, %v", got, ok, tc.want, tc.ok)
			}
		})
	}
	if sts, ok := readRuncStates(filepath.Join(proc, "missing"), proc); !ok || sts != nil {
		t.Fatalf("missing root: %v %v", sts, ok)
	}
}
