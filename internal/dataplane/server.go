package dataplane

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/aenv-dev/aenv/internal/storage/blockdev"
	"github.com/aenv-dev/aenv/internal/storage/stack"
	"github.com/aenv-dev/aenv/internal/storage/zfile"
	"golang.org/x/sys/unix"
)

// Server is the data-plane daemon: it serves disks and answers the socket API. It does no
// API or orchestration work; every decision is the node's.
type Server struct {
	// Build names the binary (its version), for Stats and the node's logs.
	Build string
	Log   *slog.Logger
	// FUSEDir, when set, is where the server mounts the one FUSE filesystem that serves
	// all its disks (see blockdev.Files), at the first disk; empty gives each disk a mount
	// of its own.
	FUSEDir string

	// lowers are the lower layers open, shared by the disks using them.
	lowers *stack.Lowers

	mu      sync.Mutex
	disks   map[string]*served // by dir
	opening map[string]bool
	started time.Time
	stop    chan struct{}
	once    sync.Once

	filesMu sync.Mutex
	files   *blockdev.Files
}

type served struct {
	d      *Disk
	opened time.Time
}

// blockCacheBytes bounds the decompressed blocks of compressed lowers the data plane keeps
// for all its disks: what the sandboxes of a template read as they mount their roots and
// start their first processes, decompressed once instead of once per sandbox.
const blockCacheBytes = 32 << 20

// NewServer returns a server with no disks.
func NewServer(build string, log *slog.Logger) *Server {
	if log == nil {
		log = slog.Default()
	}
	return &Server{Build: build, Log: log, lowers: stack.NewLowersCached(zfile.NewBlockCache(blockCacheBytes)), disks: map[string]*served{}, opening: map[string]bool{},
		started: time.Now(), stop: make(chan struct{})}
}

// Serve answers connections on ln until ctx ends or a shutdown request is granted (it is
// only while no disk is served). Disks stay open when it returns; Close closes them.
func (s *Server) Serve(ctx context.Context, ln net.Listener) error {
	go func() {
		select {
		case <-ctx.Done():
		case <-s.stop:
		}
		ln.Close()
	}()
	var wg sync.WaitGroup
	defer wg.Wait()
	for {
		c, err := ln.Accept()
		if err != nil {
			select {
			case <-s.stop:
				return nil
			default:
			}
			if ctx.Err() != nil {
				return nil
			}
			return fmt.Errorf("dataplane: accept: %w", err)
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			s.handle(c)
		}()
	}
}

// Stopped is closed once a shutdown request was granted.
func (s *Server) Stopped() <-chan struct{} { return s.stop }

// Close closes every disk (their sandboxes' roots fail from then on).
func (s *Server) Close() error {
	s.mu.Lock()
	disks := s.disks
	s.disks = map[string]*served{}
	s.mu.Unlock()
	var errs []error
	for _, d := range disks {
		errs = append(errs, d.d.Close())
	}
	return errors.Join(append(errs, s.closeFiles())...)
}

// closeFiles unmounts the shared mount, if any.
func (s *Server) closeFiles() error {
	s.filesMu.Lock()
	defer s.filesMu.Unlock()
	if s.files == nil {
		return nil
	}
	err := s.files.Close()
	s.files = nil
	return err
}

// sharedFiles is the shared mount of FUSEDir, mounted at the first call; nil without
// FUSEDir.
func (s *Server) sharedFiles(ctx context.Context) (*blockdev.Files, error) {
	if s.FUSEDir == "" {
		return nil, nil
	}
	s.filesMu.Lock()
	defer s.filesMu.Unlock()
	if s.files == nil {
		f, err := blockdev.ServeFiles(ctx, s.FUSEDir)
		if err != nil {
			return nil, fmt.Errorf("dataplane: %w", err)
		}
		s.files = f
	}
	return s.files, nil
}

// NumDisks is how many disks are served.
func (s *Server) NumDisks() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.disks)
}

// handle serves one connection: a hello, then requests until EOF. A snapshot begun on it
// is ended when it closes.
func (s *Server) handle(c net.Conn) {
	defer c.Close()
	r := bufio.NewReader(c)
	enc := json.NewEncoder(c)
	var snap Snapshot
	var snapDir string
	defer func() {
		if snap != nil {
			s.Log.Info("dataplane: connection closed in the middle of a snapshot; ending it", "dir", snapDir)
			snap.End()
		}
	}()
	hello := false
	for {
		line, err := r.ReadBytes('\n')
		if err != nil {
			return
		}
		var req request
		if err := json.Unmarshal(line, &req); err != nil {
			_ = enc.Encode(response{Error: "dataplane: bad request: " + err.Error()})
			return
		}
		if !hello {
			if req.Op != opHello {
				_ = enc.Encode(response{Error: "dataplane: hello first", Code: codeVersion, Version: APIVersion})
				return
			}
			if req.Version != APIVersion {
				_ = enc.Encode(response{Error: fmt.Sprintf("dataplane: API version %d is not this data plane's %d", req.Version, APIVersion),
					Code: codeVersion, Version: APIVersion, Build: s.Build})
				return
			}
			hello = true
			if err := enc.Encode(response{Version: APIVersion, Build: s.Build}); err != nil {
				return
			}
			continue
		}
		var resp response
		switch req.Op {
		case opSnapBegin, opSnapQuiet, opSnapSeal, opSnapFinish:
			resp = s.snapshotOp(&snap, &snapDir, req)
		default:
			resp = s.do(req)
		}
		if err := enc.Encode(resp); err != nil {
			return
		}
	}
}

func errResp(err error, code string) response {
	if code == "" && errors.Is(err, stack.ErrBroken) {
		code = codeBroken
	}
	return response{Error: err.Error(), Code: code}
}

func (s *Server) do(req request) response {
	switch req.Op {
	case opOpen:
		if req.Spec == nil {
			return errResp(errors.New("dataplane: open without a spec"), "")
		}
		info, err := s.open(*req.Spec)
		if err != nil {
			return errResp(err, "")
		}
		return response{Info: &info}
	case opList:
		return response{Disks: s.list()}
	case opClose:
		d := s.take(req.Dir)
		if d == nil {
			return errResp(fmt.Errorf("dataplane: no disk %s", req.Dir), codeNotFound)
		}
		if err := d.Close(); errors.Is(err, blockdev.ErrStillInUse) {
			return errResp(err, codeInUse)
		} else if err != nil {
			return errResp(err, "")
		}
		s.Log.Debug("dataplane: disk closed", "dir", req.Dir)
		return response{}
	case opDropSyncs:
		d := s.get(req.Dir)
		if d == nil {
			return errResp(fmt.Errorf("dataplane: no disk %s", req.Dir), codeNotFound)
		}
		if err := d.DropSyncs(); err != nil {
			return errResp(err, "")
		}
		return response{}
	case opStats:
		st := s.stats()
		return response{Stats: &st}
	case opShutdown:
		s.mu.Lock()
		n := len(s.disks) + len(s.opening)
		s.mu.Unlock()
		if n > 0 {
			return errResp(fmt.Errorf("dataplane: %d disks still served", n), codeBusy)
		}
		// Unmounted before the socket closes: whoever waits for the data plane to stop
		// answering finds its mount gone too (and may remove its directory).
		if err := s.closeFiles(); err != nil {
			s.Log.Warn("dataplane: unmount the shared mount", "err", err)
		}
		s.once.Do(func() { close(s.stop) })
		return response{}
	}
	return errResp(fmt.Errorf("dataplane: unknown op %q", req.Op), codeUnknown)
}

func (s *Server) open(spec Spec) (Info, error) {
	if err := spec.Validate(); err != nil {
		return Info{}, err
	}
	s.mu.Lock()
	if s.disks[spec.Dir] != nil || s.opening[spec.Dir] {
		s.mu.Unlock()
		return Info{}, fmt.Errorf("dataplane: disk %s is already open", spec.Dir)
	}
	s.opening[spec.Dir] = true
	s.mu.Unlock()
	// Not bound to the request: a node that dies meanwhile finds the disk in the list.
	ctx := context.Background()
	files, err := s.sharedFiles(ctx)
	var d *Disk
	if err == nil {
		d, err = OpenDisk(ctx, spec, Options{Lowers: s.lowers, Files: files, Log: s.Log})
	}
	s.mu.Lock()
	delete(s.opening, spec.Dir)
	var sv *served
	if err == nil {
		sv = &served{d: d, opened: time.Now()}
		s.disks[spec.Dir] = sv
	}
	s.mu.Unlock()
	if err != nil {
		return Info{}, err
	}
	s.Log.Debug("dataplane: disk opened", "dir", spec.Dir, "lowers", len(spec.Lowers))
	return sv.info(), nil
}

func (sv *served) info() Info {
	return Info{Dir: sv.d.Dir(), Path: sv.d.Path(), Size: sv.d.Size(), Lowers: sv.d.Lowers(), Opened: sv.opened}
}

func (s *Server) list() []Info {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make([]Info, 0, len(s.disks))
	for _, sv := range s.disks {
		out = append(out, sv.info())
	}
	return out
}

func (s *Server) get(dir string) *Disk {
	s.mu.Lock()
	defer s.mu.Unlock()
	if sv := s.disks[dir]; sv != nil {
		return sv.d
	}
	return nil
}

func (s *Server) take(dir string) *Disk {
	s.mu.Lock()
	defer s.mu.Unlock()
	sv := s.disks[dir]
	if sv == nil {
		return nil
	}
	delete(s.disks, dir)
	return sv.d
}

func (s *Server) snapshotOp(snap *Snapshot, snapDir *string, req request) response {
	if req.Op == opSnapBegin {
		if *snap != nil {
			return errResp(errors.New("dataplane: a snapshot is already in progress on this connection"), "")
		}
		d := s.get(req.Dir)
		if d == nil {
			return errResp(fmt.Errorf("dataplane: no disk %s", req.Dir), codeNotFound)
		}
		sn, err := d.BeginSnapshot(context.Background())
		if err != nil {
			return errResp(err, "")
		}
		*snap, *snapDir = sn, req.Dir
		return response{}
	}
	if *snap == nil {
		return errResp(errors.New("dataplane: no snapshot in progress"), "")
	}
	ctx := context.Background()
	switch req.Op {
	case opSnapQuiet:
		if err := (*snap).Quiet(ctx); err != nil {
			return errResp(err, "")
		}
		return response{}
	case opSnapSeal:
		ref, err := (*snap).Seal(ctx, req.Output)
		if err != nil {
			return errResp(err, "")
		}
		return response{Ref: &ref}
	default: // finish
		lowers, durable, err := (*snap).Finish(ctx)
		(*snap).End()
		*snap = nil
		if err != nil {
			return errResp(err, "")
		}
		return response{Lowers: lowers, Durable: durable}
	}
}

func (s *Server) stats() Stats {
	st := Stats{PID: os.Getpid(), APIVersion: APIVersion, Build: s.Build, Started: s.started, Disks: s.NumDisks()}
	st.RSSBytes = selfRSS()
	st.Layers = s.lowers.Stats().Layers
	st.BlockCache = s.lowers.CacheStats()
	var ru unix.Rusage
	if unix.Getrusage(unix.RUSAGE_SELF, &ru) == nil {
		st.CPU = time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
	}
	return st
}

// selfRSS reads VmRSS from /proc/self/status.
func selfRSS() int64 {
	raw, err := os.ReadFile("/proc/self/status")
	if err != nil {
		return 0
	}
	for _, line := range strings.Split(string(raw), "\n") {
		if v, ok := strings.CutPrefix(line, "VmRSS:"); ok {
			kb, err := strconv.ParseInt(strings.TrimSuffix(strings.TrimSpace(v), " kB"), 10, 64)
			if err == nil {
				return kb << 10
			}
		}
	}
	return 0
}
