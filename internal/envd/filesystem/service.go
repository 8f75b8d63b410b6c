// Package filesystem implements E2B's filesystem.Filesystem Connect service.
package filesystem

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"net/http"
	"os"
	"path/filepath"
	"sync"

	"connectrpc.com/connect"

	pb "github.com/aenv-dev/aenv/internal/envd/gen/filesystem"
	"github.com/aenv-dev/aenv/internal/envd/gen/filesystem/filesystemconnect"
	"github.com/aenv-dev/aenv/internal/envd/identity"
	"github.com/aenv-dev/aenv/internal/envd/state"
)

// Service implements filesystemconnect.FilesystemHandler.
type Service struct {
	defaults *state.Defaults
	users    identity.DB

	mu       sync.Mutex
	watchers map[string]*pollWatcher
}

var _ filesystemconnect.FilesystemHandler = (*Service)(nil)

// New returns a Service.
func New(defaults *state.Defaults, users identity.DB) *Service {
	if defaults == nil {
		defaults = state.New("root")
	}
	return &Service{defaults: defaults, users: users, watchers: map[string]*pollWatcher{}}
}

// resolve returns the acting user and the absolute form of p.
func (s *Service) resolve(h http.Header, p string) (*identity.User, string, error) {
	snap := s.defaults.Snapshot()
	name, ok := identity.BasicUser(h.Get("Authorization"))
	if !ok {
		name = snap.User
	}
	u, err := s.users.Lookup(name)
	if err != nil {
		return nil, "", connect.NewError(connect.CodeUnauthenticated, fmt.Errorf("invalid username: '%s'", name))
	}
	return u, identity.Resolve(p, u, snap.Workdir), nil
}

// Stat implements the Stat RPC.
func (s *Service) Stat(ctx context.Context, req *connect.Request[pb.StatRequest]) (*connect.Response[pb.StatResponse], error) {
	_, p, err := s.resolve(req.Header(), req.Msg.GetPath())
	if err != nil {
		return nil, err
	}
	e, err := statEntry(p, s.users.Names())
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(&pb.StatResponse{Entry: e}), nil
}

// MakeDir implements the MakeDir RPC: already_exists for an existing directory.
func (s *Service) MakeDir(ctx context.Context, req *connect.Request[pb.MakeDirRequest]) (*connect.Response[pb.MakeDirResponse], error) {
	u, p, err := s.resolve(req.Header(), req.Msg.GetPath())
	if err != nil {
		return nil, err
	}
	if fi, err := os.Stat(p); err == nil {
		if fi.IsDir() {
			return nil, connect.NewError(connect.CodeAlreadyExists, fmt.Errorf("directory already exists: %s", p))
		}
		return nil, connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("path already exists but it is not a directory: %s", p))
	} else if !errors.Is(err, fs.ErrNotExist) {
		return nil, fsError(err, p)
	}
	if err := MkdirAllOwned(p, int(u.UID), int(u.GID)); err != nil {
		return nil, fsError(err, p)
	}
	e, err := statEntry(p, s.users.Names())
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(&pb.MakeDirResponse{Entry: e}), nil
}

// Move implements the Move RPC; missing destination parents are created.
func (s *Service) Move(ctx context.Context, req *connect.Request[pb.MoveRequest]) (*connect.Response[pb.MoveResponse], error) {
	u, src, err := s.resolve(req.Header(), req.Msg.GetSource())
	if err != nil {
		return nil, err
	}
	_, dst, _ := s.resolve(req.Header(), req.Msg.GetDestination())
	if _, err := os.Lstat(src); err != nil {
		return nil, fsError(err, src)
	}
	if err := MkdirAllOwned(filepath.Dir(dst), int(u.UID), int(u.GID)); err != nil {
		return nil, fsError(err, filepath.Dir(dst))
	}
	if err := os.Rename(src, dst); err != nil {
		return nil, fsError(err, dst)
	}
	e, err := statEntry(dst, s.users.Names())
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(&pb.MoveResponse{Entry: e}), nil
}

// Remove implements the Remove RPC (recursive; a missing path is not an error, as in E2B).
func (s *Service) Remove(ctx context.Context, req *connect.Request[pb.RemoveRequest]) (*connect.Response[pb.RemoveResponse], error) {
	_, p, err := s.resolve(req.Header(), req.Msg.GetPath())
	if err != nil {
		return nil, err
	}
	if p == "/" {
		return nil, connect.NewError(connect.CodeInvalidArgument, errors.New("refusing to remove /"))
	}
	if err := os.RemoveAll(p); err != nil {
		return nil, fsError(err, p)
	}
	return connect.NewResponse(&pb.RemoveResponse{}), nil
}

// ListDir implements the ListDir RPC: entries up to depth levels below the directory (symlinked
// directories are not descended), paths joined to the requested path.
func (s *Service) ListDir(ctx context.Context, req *connect.Request[pb.ListDirRequest]) (*connect.Response[pb.ListDirResponse], error) {
	_, p, err := s.resolve(req.Header(), req.Msg.GetPath())
	if err != nil {
		return nil, err
	}
	depth := int(req.Msg.GetDepth())
	if depth <= 0 {
		depth = 1
	}
	real, err := filepath.EvalSymlinks(p)
	if err != nil {
		return nil, fsError(err, p)
	}
	fi, err := os.Stat(real)
	if err != nil {
		return nil, fsError(err, p)
	}
	if !fi.IsDir() {
		return nil, connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("path is not a directory: %s", p))
	}
	names := s.users.Names()
	var entries []*pb.EntryInfo
	var walk func(dir, shown string, level int) error
	walk = func(dir, shown string, level int) error {
		if err := ctx.Err(); err != nil {
			return err
		}
		des, err := os.ReadDir(dir)
		if err != nil {
			if level > 1 && (errors.Is(err, fs.ErrPermission) || errors.Is(err, fs.ErrNotExist)) {
				return nil // unreadable or vanished subdirectory: skip it
			}
			return err
		}
		for _, de := range des {
			info, err := de.Info()
			if err != nil {
				continue // removed meanwhile
			}
			full, show := filepath.Join(dir, de.Name()), filepath.Join(shown, de.Name())
			entries = append(entries, toEntry(show, info, names))
			if de.IsDir() && level < depth {
				if err := walk(full, show, level+1); err != nil {
					return err
				}
			}
		}
		return nil
	}
	if err := walk(real, p, 1); err != nil {
		if errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) {
			return nil, connect.NewError(connect.CodeDeadlineExceeded, err)
		}
		return nil, fsError(err, p)
	}
	return connect.NewResponse(&pb.ListDirResponse{Entries: entries}), nil
}
