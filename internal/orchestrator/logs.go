package orchestrator

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"github.com/aenv-dev/aenv/internal/envdclient"
)

// Log levels of sandbox log entries (E2B's LogLevel).
const (
	LevelDebug = "debug"
	LevelInfo  = "info"
	LevelWarn  = "warn"
	LevelError = "error"
)

var levelRank = map[string]int{LevelDebug: 0, LevelInfo: 1, LevelWarn: 2, LevelError: 3}

// ValidLogLevel reports whether s is one of the E2B log levels.
func ValidLogLevel(s string) bool { _, ok := levelRank[s]; return ok }

const (
	// maxLogEntries bounds the entries kept per sandbox (oldest dropped first).
	maxLogEntries = 2000
	// maxLogFileBytes bounds a sandbox's log file: past it the file is rewritten from
	// the entries still kept.
	maxLogFileBytes = 1 << 20
	// maxLogLine bounds one entry's message; longer output lines are cut.
	maxLogLine = 4096
	// MaxLogLimit is the most entries one query returns.
	MaxLogLimit = 1000
)

// LogEntry is one sandbox log line: the template start command's output or a node
// lifecycle event.
type LogEntry struct {
	Time    time.Time         `json:"t"`
	Level   string            `json:"l"`
	Message string            `json:"m"`
	Fields  map[string]string `json:"f,omitempty"`
}

// LogQuery selects log entries. Forward returns entries at or after Cursor, oldest
// first; backward entries at or before Cursor (zero: now), newest first.
type LogQuery struct {
	Cursor   time.Time
	Forward  bool
	Limit    int    // 0 or more than MaxLogLimit: MaxLogLimit
	MinLevel string // "" = all
	Search   string // case-sensitive substring of the message
}

// logStore keeps each sandbox's recent log entries in memory and in a JSON-lines file
// under dir, so a paused sandbox and a restarted node still have them. Both are bounded.
type logStore struct {
	dir string

	mu   sync.Mutex
	bufs map[string]*logBuf
	// followers counts the start commands' output captures still running; stopFollowing
	// waits for them, so none writes after the node is gone (and re-creates its log
	// directory).
	followers sync.WaitGroup
}

type logBuf struct {
	mu        sync.Mutex
	loaded    bool
	entries   []LogEntry
	fileBytes int64
	dropped   bool
	follow    context.CancelFunc // stops the start command's output capture
	followCtx context.Context    // done once the capture stopped
}

func newLogStore(dir string) *logStore {
	return &logStore{dir: dir, bufs: map[string]*logBuf{}}
}

func (s *logStore) path(id string) string { return filepath.Join(s.dir, id+".jsonl") }

func (s *logStore) buf(id string) *logBuf {
	s.mu.Lock()
	defer s.mu.Unlock()
	b := s.bufs[id]
	if b == nil {
		b = &logBuf{}
		s.bufs[id] = b
	}
	return b
}

// load reads the file once (entries written before a restart); b.mu must be held.
func (s *logStore) load(id string, b *logBuf) {
	if b.loaded {
		return
	}
	b.loaded = true
	raw, err := os.ReadFile(s.path(id))
	if err != nil {
		return
	}
	b.fileBytes = int64(len(raw))
	sc := bufio.NewScanner(bytes.NewReader(raw))
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		var e LogEntry
		if json.Unmarshal(sc.Bytes(), &e) == nil {
			b.entries = append(b.entries, e)
		}
	}
	b.trim()
}

// add appends entries of sandbox id. Persistence failures are returned but the entries
// are kept in memory either way.
func (s *logStore) add(id string, entries ...LogEntry) error {
	return s.addTo(id, s.buf(id), entries...)
}

// addTo appends to b, the buffer of id as it was when the writer started: once id is
// dropped, late writes (a start command's last output) are discarded instead of
// re-creating its file.
func (s *logStore) addTo(id string, b *logBuf, entries ...LogEntry) error {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.dropped {
		return nil
	}
	s.load(id, b)
	b.entries = append(b.entries, entries...)
	b.trim()
	out, err := encodeEntries(entries)
	if err != nil {
		return err
	}
	if b.fileBytes+int64(len(out)) > maxLogFileBytes {
		return s.rewrite(id, b)
	}
	if err := os.MkdirAll(s.dir, 0o700); err != nil {
		return fmt.Errorf("sandbox logs: %w", err)
	}
	f, err := os.OpenFile(s.path(id), os.O_WRONLY|os.O_APPEND|os.O_CREATE, 0o600)
	if err != nil {
		return fmt.Errorf("sandbox logs: %w", err)
	}
	n, werr := f.Write(out)
	b.fileBytes += int64(n)
	if cerr := f.Close(); werr == nil {
		werr = cerr
	}
	if werr != nil {
		return fmt.Errorf("sandbox logs of %s: %w", id, werr)
	}
	return nil
}

// trim drops the oldest entries past maxLogEntries; b.mu must be held.
func (b *logBuf) trim() {
	if n := len(b.entries); n > maxLogEntries {
		b.entries = append([]LogEntry(nil), b.entries[n-maxLogEntries:]...)
	}
}

// encodeEntries encodes entries as JSON lines, the file's format.
func encodeEntries(entries []LogEntry) ([]byte, error) {
	var out bytes.Buffer
	for _, e := range entries {
		line, err := json.Marshal(e)
		if err != nil {
			return nil, fmt.Errorf("encode log entry: %w", err)
		}
		out.Write(line)
		out.WriteByte('\n')
	}
	return out.Bytes(), nil
}

// rewrite replaces the file with the kept entries; b.mu must be held.
func (s *logStore) rewrite(id string, b *logBuf) error {
	data, err := encodeEntries(b.entries)
	if err != nil {
		return err
	}
	// Keep the newest entries that fit in half the budget, so rewrites stay rare.
	for len(data) > maxLogFileBytes/2 {
		i := bytes.IndexByte(data, '\n')
		data = data[i+1:]
	}
	if err := os.MkdirAll(s.dir, 0o700); err != nil {
		return fmt.Errorf("sandbox logs: %w", err)
	}
	tmp := s.path(id) + ".tmp"
	if err := os.WriteFile(tmp, data, 0o600); err != nil {
		return fmt.Errorf("sandbox logs of %s: %w", id, err)
	}
	if err := os.Rename(tmp, s.path(id)); err != nil {
		return fmt.Errorf("sandbox logs of %s: %w", id, err)
	}
	b.fileBytes = int64(len(data))
	return nil
}

// query returns the entries of id matching q.
func (s *logStore) query(id string, q LogQuery) []LogEntry {
	b := s.buf(id)
	b.mu.Lock()
	defer b.mu.Unlock()
	s.load(id, b)
	limit := q.Limit
	if limit <= 0 || limit > MaxLogLimit {
		limit = MaxLogLimit
	}
	min := levelRank[q.MinLevel]
	match := func(e LogEntry) bool {
		return levelRank[e.Level] >= min && (q.Search == "" || strings.Contains(e.Message, q.Search))
	}
	out := []LogEntry{}
	if q.Forward {
		for _, e := range b.entries {
			if len(out) == limit {
				break
			}
			if !e.Time.Before(q.Cursor) && match(e) {
				out = append(out, e)
			}
		}
		return out
	}
	for i := len(b.entries) - 1; i >= 0 && len(out) < limit; i-- {
		e := b.entries[i]
		if (q.Cursor.IsZero() || !e.Time.After(q.Cursor)) && match(e) {
			out = append(out, e)
		}
	}
	return out
}

// setFollow registers the cancel of the start command's output capture, stopping the
// previous one (a sandbox booted afresh runs its start command again).
func (s *logStore) setFollow(b *logBuf, ctx context.Context, cancel context.CancelFunc) {
	b.mu.Lock()
	prev, dropped := b.follow, b.dropped
	b.follow, b.followCtx = cancel, ctx
	b.mu.Unlock()
	if prev != nil {
		prev()
	}
	if dropped {
		cancel()
	}
}

// drop forgets sandbox id: memory, file and output capture.
func (s *logStore) drop(id string) error {
	s.mu.Lock()
	b := s.bufs[id]
	delete(s.bufs, id)
	s.mu.Unlock()
	if b != nil {
		b.mu.Lock()
		b.dropped = true
		if b.follow != nil {
			b.follow()
		}
		b.mu.Unlock()
	}
	if err := os.Remove(s.path(id)); err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("sandbox logs of %s: %w", id, err)
	}
	return nil
}

// logEvent records a lifecycle event of sandbox id; failures only reach the node log.
func (o *Orchestrator) logEvent(id, level, msg string, fields map[string]string) {
	if err := o.logs.add(id, LogEntry{Time: o.clock.Now().UTC(), Level: level, Message: msg, Fields: fields}); err != nil {
		o.log.Warn("sandbox log", "sandbox", id, "err", err)
	}
}

// Logs returns the log entries of sandbox id (running or paused) matching q.
// Errors: ErrNotFound.
func (o *Orchestrator) Logs(ctx context.Context, id string, q LogQuery) ([]LogEntry, error) {
	if q.MinLevel != "" && !ValidLogLevel(q.MinLevel) {
		return nil, fmt.Errorf("%w: log level %q is not one of debug, info, warn, error", ErrInvalid, q.MinLevel)
	}
	o.mu.Lock()
	_, ok := o.entries[id]
	o.mu.Unlock()
	if !ok {
		return nil, fmt.Errorf("%w: %s", ErrNotFound, id)
	}
	return o.logs.query(id, q), nil
}

// lineWriter turns a stream of output chunks into log entries, one per line.
type lineWriter struct {
	o       *Orchestrator
	id      string
	buf     *logBuf
	level   string
	fields  map[string]string
	pending []byte
}

func (w *lineWriter) Write(p []byte) (int, error) {
	w.pending = append(w.pending, p...)
	var entries []LogEntry
	now := w.o.clock.Now().UTC()
	for {
		i := bytes.IndexByte(w.pending, '\n')
		if i < 0 {
			break
		}
		entries = append(entries, w.entry(now, w.pending[:i]))
		w.pending = w.pending[i+1:]
	}
	if len(w.pending) > maxLogLine {
		entries = append(entries, w.entry(now, w.pending))
		w.pending = nil
	}
	if len(entries) > 0 {
		if err := w.o.logs.addTo(w.id, w.buf, entries...); err != nil {
			w.o.log.Warn("sandbox log", "sandbox", w.id, "err", err)
		}
	}
	return len(p), nil
}

func (w *lineWriter) entry(now time.Time, line []byte) LogEntry {
	line = bytes.TrimSuffix(line, []byte("\r"))
	if len(line) > maxLogLine {
		line = line[:maxLogLine]
	}
	return LogEntry{Time: now, Level: w.level, Message: strings.ToValidUTF8(string(line), "\uFFFD"), Fields: w.fields}
}

// flush logs a last line without a newline.
func (w *lineWriter) flush() {
	if len(w.pending) > 0 {
		_ = w.o.logs.addTo(w.id, w.buf, w.entry(w.o.clock.Now().UTC(), w.pending))
		w.pending = nil
	}
}

// Events that frame the start command's output; startCommandPid reads them back.
const (
	msgStartCmdStarted    = "start command started"
	msgStartCmdReattached = "start command output re-attached"
	msgStartCmdEnded      = "start command ended"
	msgStartCmdGone       = "start command no longer running when re-attaching its output"
)

// startCommandPid reads from the logs of id whether its start command was last seen
// running and with which pid (0: no record of it, as when the entries were cut).
func (s *logStore) startCommandPid(id string) (pid uint32, running bool) {
	b := s.buf(id)
	b.mu.Lock()
	defer b.mu.Unlock()
	s.load(id, b)
	for i := len(b.entries) - 1; i >= 0; i-- {
		switch e := b.entries[i]; e.Message {
		case msgStartCmdEnded, msgStartCmdGone:
			return 0, false
		case msgStartCmdStarted, msgStartCmdReattached:
			var n uint32
			if _, err := fmt.Sscan(e.Fields["pid"], &n); err != nil {
				return 0, true
			}
			return n, true
		}
	}
	return 0, true
}

// following reports whether the start command's output of id is being captured.
func (s *logStore) following(id string) bool {
	b := s.buf(id)
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.followCtx != nil && b.followCtx.Err() == nil
}

// stopFollowing stops every output capture (the node is going away) and waits, until ctx
// is done, for the captures to write their last lines.
func (s *logStore) stopFollowing(ctx context.Context) error {
	s.mu.Lock()
	bufs := make([]*logBuf, 0, len(s.bufs))
	for _, b := range s.bufs {
		bufs = append(bufs, b)
	}
	s.mu.Unlock()
	for _, b := range bufs {
		b.mu.Lock()
		if b.follow != nil {
			b.follow()
		}
		b.mu.Unlock()
	}
	if err := waitGroup(ctx, &s.followers); err != nil {
		return fmt.Errorf("start commands' output captures still running: %w", err)
	}
	return nil
}

// stopFollowingOf stops the output capture of id, if any: the stream it reads belongs to
// an instance that is gone.
func (s *logStore) stopFollowingOf(id string) {
	b := s.buf(id)
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.follow != nil {
		b.follow()
	}
}

// streamClient reaches envd for long-lived streams: the envd client's overall timeout
// would cut them after seconds.
func (o *Orchestrator) streamClient() *http.Client {
	return &http.Client{Transport: o.envd.Transport}
}

// followStartCommand copies the start command's output into the sandbox's logs in the
// background until the process ends or cancel is called (sandbox removed, or its start
// command started again).
// msg is the event that opens the capture: msgStartCmdStarted or msgStartCmdReattached.
func (o *Orchestrator) followStartCommand(id string, p *envdclient.Process, ctx context.Context, cancel context.CancelFunc, msg string) {
	b := o.logs.buf(id)
	_ = o.logs.addTo(id, b, LogEntry{Time: o.clock.Now().UTC(), Level: LevelInfo, Message: msg,
		Fields: map[string]string{"pid": fmt.Sprint(p.Pid)}})
	o.logs.setFollow(b, ctx, cancel)
	o.logs.followers.Add(1)
	go func() {
		defer o.logs.followers.Done()
		defer cancel()
		defer p.Close()
		out := &lineWriter{o: o, id: id, buf: b, level: LevelInfo, fields: map[string]string{"stream": "stdout"}}
		errw := &lineWriter{o: o, id: id, buf: b, level: LevelWarn, fields: map[string]string{"stream": "stderr"}}
		end, err := p.Wait(out, errw)
		out.flush()
		errw.flush()
		if err != nil || end == nil {
			return
		}
		level := LevelInfo
		if end.GetExitCode() != 0 || !end.GetExited() {
			level = LevelError
		}
		_ = o.logs.addTo(id, b, LogEntry{Time: o.clock.Now().UTC(), Level: level, Message: msgStartCmdEnded,
			Fields: map[string]string{"exitCode": fmt.Sprint(end.GetExitCode()), "status": end.GetStatus()}})
	}()
}

// sweepLogs removes the log files of sandboxes the node no longer has (dropped at
// Start, or removed while a write failed).
func (o *Orchestrator) sweepLogs() {
	ents, err := os.ReadDir(o.logs.dir)
	if err != nil {
		return
	}
	for _, ent := range ents {
		id, ok := strings.CutSuffix(ent.Name(), ".jsonl")
		if !ok {
			id, ok = strings.CutSuffix(ent.Name(), ".jsonl.tmp")
		}
		if !ok {
			continue
		}
		o.mu.Lock()
		_, live := o.entries[id]
		o.mu.Unlock()
		if !live {
			if err := os.Remove(filepath.Join(o.logs.dir, ent.Name())); err != nil {
				o.log.Warn("delete stale sandbox logs", "file", ent.Name(), "err", err)
			}
		}
	}
}
