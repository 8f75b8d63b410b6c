package filesystem

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strconv"
	"sync"
	"time"

	"connectrpc.com/connect"
	"github.com/fsnotify/fsnotify"

	pb "github.com/aenv-dev/aenv/internal/envd/gen/filesystem"
	"github.com/aenv-dev/aenv/internal/envd/identity"
)

const (
	defaultKeepalive = 90 * time.Second
	maxPolledEvents  = 10000 // per CreateWatcher watcher; older events are dropped beyond this
)

// dirWatcher turns inotify events under root into FilesystemEvents with names relative to root.
type dirWatcher struct {
	w            *fsnotify.Watcher
	root         string
	recursive    bool
	includeEntry bool
	names        *identity.Names
	out          chan *pb.FilesystemEvent
	stop         chan struct{}
	done         chan struct{}
}

func newDirWatcher(root string, recursive, includeEntry bool, names *identity.Names) (*dirWatcher, error) {
	fi, err := os.Stat(root)
	if err != nil {
		return nil, fsError(err, root)
	}
	if !fi.IsDir() {
		return nil, connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("path is not a directory: %s", root))
	}
	w, err := fsnotify.NewWatcher()
	if err != nil {
		return nil, connect.NewError(connect.CodeInternal, fmt.Errorf("error creating watcher: %w", err))
	}
	d := &dirWatcher{w: w, root: root, recursive: recursive, includeEntry: includeEntry, names: names,
		out: make(chan *pb.FilesystemEvent, 64), stop: make(chan struct{}), done: make(chan struct{})}
	if err := d.add(root); err != nil {
		w.Close()
		return nil, connect.NewError(connect.CodeInternal, fmt.Errorf("error watching %s: %w", root, err))
	}
	go d.loop()
	return d, nil
}

// add watches dir and, when recursive, every directory below it.
func (d *dirWatcher) add(dir string) error {
	if err := d.w.Add(dir); err != nil {
		return err
	}
	if !d.recursive {
		return nil
	}
	return filepath.WalkDir(dir, func(p string, de fs.DirEntry, err error) error {
		if err != nil {
			return nil // unreadable subtree: skip
		}
		if de.IsDir() && p != dir {
			_ = d.w.Add(p)
		}
		return nil
	})
}

func (d *dirWatcher) close() {
	select {
	case <-d.stop:
	default:
		close(d.stop)
	}
	d.w.Close()
	<-d.done
}

func (d *dirWatcher) loop() {
	defer close(d.done)
	defer close(d.out)
	for {
		select {
		case ev, ok := <-d.w.Events:
			if !ok {
				return
			}
			if d.recursive && ev.Has(fsnotify.Create) {
				if fi, err := os.Lstat(ev.Name); err == nil && fi.IsDir() {
					_ = d.add(ev.Name)
				}
			}
			rel, err := filepath.Rel(d.root, ev.Name)
			if err != nil {
				rel = ev.Name
			}
			for _, m := range []struct {
				op fsnotify.Op
				t  pb.EventType
			}{
				{fsnotify.Create, pb.EventType_EVENT_TYPE_CREATE},
				{fsnotify.Write, pb.EventType_EVENT_TYPE_WRITE},
				{fsnotify.Remove, pb.EventType_EVENT_TYPE_REMOVE},
				{fsnotify.Rename, pb.EventType_EVENT_TYPE_RENAME},
				{fsnotify.Chmod, pb.EventType_EVENT_TYPE_CHMOD},
			} {
				if !ev.Has(m.op) {
					continue
				}
				fe := &pb.FilesystemEvent{Name: rel, Type: m.t}
				if d.includeEntry && m.t != pb.EventType_EVENT_TYPE_REMOVE && m.t != pb.EventType_EVENT_TYPE_RENAME {
					if fi, err := os.Lstat(ev.Name); err == nil {
						fe.Entry = toEntry(ev.Name, fi, d.names)
					}
				}
				select {
				case d.out <- fe:
				case <-d.stop:
					return
				}
			}
		case _, ok := <-d.w.Errors:
			if !ok {
				return
			}
		case <-d.stop:
			return
		}
	}
}

// WatchDir implements the WatchDir stream: a start event, then events and keepalives.
func (s *Service) WatchDir(ctx context.Context, req *connect.Request[pb.WatchDirRequest], stream *connect.ServerStream[pb.WatchDirResponse]) error {
	_, p, err := s.resolve(req.Header(), req.Msg.GetPath())
	if err != nil {
		return err
	}
	d, err := newDirWatcher(p, req.Msg.GetRecursive(), req.Msg.GetIncludeEntry(), s.users.Names())
	if err != nil {
		return err
	}
	defer d.close()
	if err := stream.Send(&pb.WatchDirResponse{Event: &pb.WatchDirResponse_Start{Start: &pb.WatchDirResponse_StartEvent{}}}); err != nil {
		return err
	}
	every := defaultKeepalive
	if n, err := strconv.Atoi(req.Header().Get("Keepalive-Ping-Interval")); err == nil && n > 0 {
		every = time.Duration(n) * time.Second
	}
	ka := time.NewTimer(every)
	defer ka.Stop()
	for {
		select {
		case ev, ok := <-d.out:
			if !ok {
				return connect.NewError(connect.CodeInternal, errors.New("watcher stopped"))
			}
			if err := stream.Send(&pb.WatchDirResponse{Event: &pb.WatchDirResponse_Filesystem{Filesystem: ev}}); err != nil {
				return err
			}
			ka.Reset(every)
		case <-ka.C:
			if err := stream.Send(&pb.WatchDirResponse{Event: &pb.WatchDirResponse_Keepalive{Keepalive: &pb.WatchDirResponse_KeepAlive{}}}); err != nil {
				return err
			}
			ka.Reset(every)
		case <-ctx.Done():
			if errors.Is(ctx.Err(), context.DeadlineExceeded) {
				return connect.NewError(connect.CodeDeadlineExceeded, ctx.Err())
			}
			return connect.NewError(connect.CodeCanceled, ctx.Err())
		}
	}
}

// pollWatcher buffers events for the unary CreateWatcher / GetWatcherEvents API.
type pollWatcher struct {
	d      *dirWatcher
	mu     sync.Mutex
	events []*pb.FilesystemEvent
}

func (w *pollWatcher) collect() {
	for ev := range w.d.out {
		w.mu.Lock()
		if len(w.events) >= maxPolledEvents {
			w.events = w.events[1:]
		}
		w.events = append(w.events, ev)
		w.mu.Unlock()
	}
}

// CreateWatcher implements the CreateWatcher RPC.
func (s *Service) CreateWatcher(ctx context.Context, req *connect.Request[pb.CreateWatcherRequest]) (*connect.Response[pb.CreateWatcherResponse], error) {
	_, p, err := s.resolve(req.Header(), req.Msg.GetPath())
	if err != nil {
		return nil, err
	}
	d, err := newDirWatcher(p, req.Msg.GetRecursive(), req.Msg.GetIncludeEntry(), s.users.Names())
	if err != nil {
		return nil, err
	}
	var b [12]byte
	_, _ = rand.Read(b[:])
	id := hex.EncodeToString(b[:])
	w := &pollWatcher{d: d}
	go w.collect()
	s.mu.Lock()
	s.watchers[id] = w
	s.mu.Unlock()
	return connect.NewResponse(&pb.CreateWatcherResponse{WatcherId: id}), nil
}

// GetWatcherEvents implements the GetWatcherEvents RPC: events since the last call.
func (s *Service) GetWatcherEvents(ctx context.Context, req *connect.Request[pb.GetWatcherEventsRequest]) (*connect.Response[pb.GetWatcherEventsResponse], error) {
	s.mu.Lock()
	w := s.watchers[req.Msg.GetWatcherId()]
	s.mu.Unlock()
	if w == nil {
		return nil, connect.NewError(connect.CodeNotFound, fmt.Errorf("watcher '%s' not found", req.Msg.GetWatcherId()))
	}
	w.mu.Lock()
	evs := w.events
	w.events = nil
	w.mu.Unlock()
	return connect.NewResponse(&pb.GetWatcherEventsResponse{Events: evs}), nil
}

// RemoveWatcher implements the RemoveWatcher RPC.
func (s *Service) RemoveWatcher(ctx context.Context, req *connect.Request[pb.RemoveWatcherRequest]) (*connect.Response[pb.RemoveWatcherResponse], error) {
	s.mu.Lock()
	w := s.watchers[req.Msg.GetWatcherId()]
	delete(s.watchers, req.Msg.GetWatcherId())
	s.mu.Unlock()
	if w == nil {
		return nil, connect.NewError(connect.CodeNotFound, fmt.Errorf("watcher '%s' not found", req.Msg.GetWatcherId()))
	}
	w.d.close()
	return connect.NewResponse(&pb.RemoveWatcherResponse{}), nil
}

// Close stops every polled watcher.
func (s *Service) Close() {
	s.mu.Lock()
	ws := s.watchers
	s.watchers = map[string]*pollWatcher{}
	s.mu.Unlock()
	for _, w := range ws {
		w.d.close()
	}
}
