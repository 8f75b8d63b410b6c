package oci

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
)

// liveContainers lists the runtime's containers for Reconcile: "created" (never started),
// "running" (also for a paused one: Reconcile adopts both alike) or "stopped". For runc it
// reads runc's own state files instead of running `runc list`: one exec of runc costs
// ~0.1-0.5 s on a busy host, a large part of a restart that must answer within a second,
// while the files take a millisecond. Whatever the reader does not fully understand (an
// unreadable or unfamiliar state file, another runtime) falls back to the runtime's list.
func (r runtimeCLI) liveContainers(ctx context.Context) ([]containerState, error) {
	if r.name == "runc" {
		if sts, ok := readRuncStates(r.root, "/proc"); ok {
			return sts, nil
		}
	}
	return r.list(ctx)
}

// runcState is the part of runc's <root>/<id>/state.json (libcontainer's State) that
// decides a container's status. runc writes it through a temporary file and a rename,
// so it is never read half-written.
type runcState struct {
	ID        string  `json:"id"`
	InitPid   *int    `json:"init_process_pid"`
	InitStart *uint64 `json:"init_process_start"`
}

// readRuncStates does what `runc list` does to tell a container's status (libcontainer's
// runType): the init process must exist with the recorded start time and not be a zombie,
// and a container whose exec fifo still exists was created but never started. ok is false
// when any container's state is not understood; the caller then asks runc.
func readRuncStates(root, proc string) (sts []containerState, ok bool) {
	ents, err := os.ReadDir(root)
	if errors.Is(err, os.ErrNotExist) {
		return nil, true
	}
	if err != nil {
		return nil, false
	}
	for _, e := range ents {
		if !e.IsDir() {
			continue // runc keeps nothing but container directories here
		}
		dir := filepath.Join(root, e.Name())
		st, err := readRuncState(filepath.Join(dir, "state.json"))
		if err != nil || st.ID != e.Name() || st.InitPid == nil || st.InitStart == nil {
			return nil, false
		}
		c := containerState{ID: st.ID, Status: "stopped"}
		if alive(proc, *st.InitPid, *st.InitStart) {
			c.Pid, c.Status = *st.InitPid, "running"
			if _, err := os.Lstat(filepath.Join(dir, "exec.fifo")); err == nil {
				c.Status = "created"
			}
		}
		sts = append(sts, c)
	}
	return sts, true
}

// readRuncState reads the fields of runcState from a state file. runc writes them first
// (libcontainer's BaseState), before the container's whole config (~12 KB): decoding
// stops once it has them, so a restart with hundreds of containers reads and parses a
// few hundred bytes of each. Keys in another order are still found, further on.
func readRuncState(path string) (runcState, error) {
	var st runcState
	f, err := os.Open(path)
	if err != nil {
		return st, err
	}
	defer f.Close()
	dec := json.NewDecoder(f)
	if t, err := dec.Token(); err != nil || t != json.Delim('{') {
		return st, fmt.Errorf("%s: not a JSON object", path)
	}
	for dec.More() && (st.ID == "" || st.InitPid == nil || st.InitStart == nil) {
		t, err := dec.Token()
		if err != nil {
			return st, fmt.Errorf("%s: %w", path, err)
		}
		var v any
		switch t {
		case "id":
			v = &st.ID
		case "init_process_pid":
			v = &st.InitPid
		case "init_process_start":
			v = &st.InitStart
		default:
			v = &json.RawMessage{}
		}
		if err := dec.Decode(v); err != nil {
			return st, fmt.Errorf("%s: %w", path, err)
		}
	}
	return st, nil
}

// alive reports whether pid is a live (not zombie, not dead) process that started at
// start (clock ticks after boot, /proc/PID/stat's 22nd field): a recycled pid is not.
func alive(proc string, pid int, start uint64) bool {
	if pid <= 0 {
		return false
	}
	raw, err := os.ReadFile(filepath.Join(proc, strconv.Itoa(pid), "stat"))
	if err != nil {
		return false
	}
	s := string(raw)
	i := strings.LastIndexByte(s, ')')
	if i < 0 {
		return false
	}
	f := strings.Fields(s[i+1:]) // f[0] is field 3 (state), f[19] field 22 (starttime)
	if len(f) < 20 || f[0] == "Z" || f[0] == "X" || f[0] == "x" {
		return false
	}
	got, err := strconv.ParseUint(f[19], 10, 64)
	return err == nil && got == start
}
