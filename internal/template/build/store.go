package build

import (
	"bufio"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/aenv-dev/aenv/internal/sandbox"
)

// Status of a build, with E2B's names.
type Status string

const (
	StatusWaiting  Status = "waiting"  // requested, steps not posted yet
	StatusBuilding Status = "building" // running
	StatusReady    Status = "ready"
	StatusError    Status = "error"
)

// Finished reports whether the build has ended.
func (s Status) Finished() bool { return s == StatusReady || s == StatusError }

// Reason says why a build failed. Step is E2B's step name: "base" for the base image
// or template, "1".."N" for the steps, "finalize" for start, ready and capture.
type Reason struct {
	Message string `json:"message"`
	Step    string `json:"step,omitempty"`
}

// Record is one build of one template.
type Record struct {
	ID         string            `json:"id"`
	TemplateID string            `json:"templateID"`
	Name       string            `json:"name"`
	Status     Status            `json:"status"`
	Resources  sandbox.Resources `json:"resources"`
	Spec       *Spec             `json:"spec,omitempty"`
	// Tags are given to the build when it becomes ready (E2B's name:tag and tags).
	Tags   []string `json:"tags,omitempty"`
	Reason *Reason  `json:"reason,omitempty"`
	// SandboxID is the build sandbox while the build runs.
	SandboxID string `json:"sandboxID,omitempty"`
	// Capture is the backend capture a layered build made, recorded before its template
	// is registered: a node that stops in between gives it back at its next start.
	Capture    json.RawMessage `json:"capture,omitempty"`
	CreatedAt  time.Time       `json:"createdAt"`
	UpdatedAt  time.Time       `json:"updatedAt"`
	FinishedAt time.Time       `json:"finishedAt,omitzero"`
}

// LogEntry is one build log line.
type LogEntry struct {
	Timestamp time.Time `json:"timestamp"`
	Level     string    `json:"level"`
	Message   string    `json:"message"`
}

// Limits on what one build keeps in its log: a runaway RUN step must not fill the
// data directory.
const (
	maxLogEntries = 20000
	maxLogLine    = 4096
)

// ErrNotFound is returned for unknown templates, builds and uploads.
var ErrNotFound = errors.New("not found")

// ErrConflict is returned when a build is not in a state that allows the request.
var ErrConflict = errors.New("conflict")

// store keeps build records and logs under dir (one JSON file and one JSON-lines log
// per build), with everything also held in memory for status polling.
type store struct {
	dir  string
	mu   sync.Mutex
	recs map[string]*Record
	logs map[string][]LogEntry
}

func openStore(dir string) (*store, error) {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, fmt.Errorf("build records: %w", err)
	}
	s := &store{dir: dir, recs: map[string]*Record{}, logs: map[string][]LogEntry{}}
	ents, err := os.ReadDir(dir)
	if err != nil {
		return nil, fmt.Errorf("build records: %w", err)
	}
	for _, e := range ents {
		id, ok := strings.CutSuffix(e.Name(), ".json")
		if !ok || e.IsDir() {
			continue
		}
		raw, err := os.ReadFile(filepath.Join(dir, e.Name()))
		if err != nil {
			return nil, fmt.Errorf("build record %s: %w", id, err)
		}
		var r Record
		if err := json.Unmarshal(raw, &r); err != nil || r.ID != id {
			// A torn write from a crash: the build is lost, the node keeps starting.
			continue
		}
		s.recs[id] = &r
		s.logs[id] = readLog(filepath.Join(dir, id+".log"))
	}
	return s, nil
}

func readLog(p string) []LogEntry {
	f, err := os.Open(p)
	if err != nil {
		return nil
	}
	defer f.Close()
	var out []LogEntry
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		var e LogEntry
		if json.Unmarshal(sc.Bytes(), &e) == nil {
			out = append(out, e)
		}
	}
	return out
}

// put stores a new or updated record durably (write to a temp file, rename).
func (s *store) put(r *Record) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.putLocked(r)
}

func (s *store) putLocked(r *Record) error {
	r.UpdatedAt = time.Now().UTC()
	raw, err := json.Marshal(r)
	if err != nil {
		return err
	}
	p := filepath.Join(s.dir, r.ID+".json")
	if err := os.WriteFile(p+".tmp", raw, 0o600); err != nil {
		return fmt.Errorf("save build %s: %w", r.ID, err)
	}
	if err := os.Rename(p+".tmp", p); err != nil {
		return fmt.Errorf("save build %s: %w", r.ID, err)
	}
	c := *r
	s.recs[r.ID] = &c
	return nil
}

// update applies fn to the stored record and saves it.
func (s *store) update(id string, fn func(*Record) error) (Record, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	cur, ok := s.recs[id]
	if !ok {
		return Record{}, fmt.Errorf("build %q: %w", id, ErrNotFound)
	}
	r := *cur
	if err := fn(&r); err != nil {
		return Record{}, err
	}
	if err := s.putLocked(&r); err != nil {
		return Record{}, err
	}
	return r, nil
}

func (s *store) get(id string) (Record, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	r, ok := s.recs[id]
	if !ok {
		return Record{}, false
	}
	return *r, true
}

// list returns the records matching keep, oldest first.
func (s *store) list(keep func(*Record) bool) []Record {
	s.mu.Lock()
	defer s.mu.Unlock()
	var out []Record
	for _, r := range s.recs {
		if keep == nil || keep(r) {
			out = append(out, *r)
		}
	}
	slices.SortFunc(out, func(a, b Record) int { return a.CreatedAt.Compare(b.CreatedAt) })
	return out
}

// log appends one entry to a build's log. Lines over maxLogLine are cut; past
// maxLogEntries one marker is kept and the rest dropped.
func (s *store) log(id, level, msg string) {
	if len(msg) > maxLogLine {
		msg = msg[:maxLogLine] + "…"
	}
	e := LogEntry{Timestamp: time.Now().UTC(), Level: level, Message: msg}
	s.mu.Lock()
	defer s.mu.Unlock()
	n := len(s.logs[id])
	switch {
	case n > maxLogEntries:
		return
	case n == maxLogEntries:
		e.Level, e.Message = "warn", fmt.Sprintf("log limit of %d lines reached; further output is dropped", maxLogEntries)
	}
	s.logs[id] = append(s.logs[id], e)
	raw, _ := json.Marshal(e)
	f, err := os.OpenFile(filepath.Join(s.dir, id+".log"), os.O_CREATE|os.O_APPEND|os.O_WRONLY, 0o600)
	if err != nil {
		return // the in-memory log still serves this node's lifetime
	}
	f.Write(append(raw, '\n'))
	f.Close()
}

// logsFrom returns the entries from offset on (at most limit; 0 = all).
func (s *store) logsFrom(id string, offset, limit int) []LogEntry {
	s.mu.Lock()
	defer s.mu.Unlock()
	l := s.logs[id]
	if offset < 0 {
		offset = 0
	}
	if offset >= len(l) {
		return []LogEntry{}
	}
	l = l[offset:]
	if limit > 0 && len(l) > limit {
		l = l[:limit]
	}
	return slices.Clone(l)
}

// remove deletes a build's record and log.
func (s *store) remove(id string) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	delete(s.recs, id)
	delete(s.logs, id)
	var errs []error
	for _, p := range []string{id + ".json", id + ".log"} {
		if err := os.Remove(filepath.Join(s.dir, p)); err != nil && !errors.Is(err, fs.ErrNotExist) {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}
