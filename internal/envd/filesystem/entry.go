package filesystem

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"syscall"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/types/known/timestamppb"

	pb "github.com/aenv-dev/aenv/internal/envd/gen/filesystem"
	"github.com/aenv-dev/aenv/internal/envd/identity"
)

// fileType maps a mode to the proto enum; sockets, devices and pipes are unspecified.
func fileType(m fs.FileMode) pb.FileType {
	switch {
	case m.IsRegular():
		return pb.FileType_FILE_TYPE_FILE
	case m.IsDir():
		return pb.FileType_FILE_TYPE_DIRECTORY
	case m&fs.ModeSymlink != 0:
		return pb.FileType_FILE_TYPE_SYMLINK
	default:
		return pb.FileType_FILE_TYPE_UNSPECIFIED
	}
}

// toEntry builds an EntryInfo for path from its Lstat result.
func toEntry(path string, fi fs.FileInfo, names *identity.Names) *pb.EntryInfo {
	e := &pb.EntryInfo{
		Name:         fi.Name(),
		Type:         fileType(fi.Mode()),
		Path:         path,
		Size:         fi.Size(),
		Mode:         uint32(fi.Mode().Perm()),
		Permissions:  fi.Mode().String(),
		ModifiedTime: timestamppb.New(fi.ModTime()),
	}
	if st, ok := fi.Sys().(*syscall.Stat_t); ok {
		e.Owner = names.User(st.Uid)
		e.Group = names.Group(st.Gid)
	}
	if fi.Mode().IsRegular() || fi.IsDir() {
		e.Metadata = ReadMetadata(path)
	}
	if fi.Mode()&fs.ModeSymlink != 0 {
		// As E2B's envd: the resolved target, with the target's type and permission bits; a
		// link that does not resolve (dangling, a loop) names itself, with an unspecified
		// type (which the SDK's list leaves out) and mode 0.
		target, err := filepath.EvalSymlinks(path)
		if err != nil {
			target = path
		}
		e.SymlinkTarget = &target
		e.Type, e.Mode = pb.FileType_FILE_TYPE_UNSPECIFIED, 0
		if tfi, err := os.Stat(target); err == nil {
			e.Type, e.Mode = fileType(tfi.Mode()), uint32(tfi.Mode().Perm())
		}
	}
	return e
}

// statEntry is Lstat + toEntry, with not_found for a missing path.
func statEntry(path string, names *identity.Names) (*pb.EntryInfo, error) {
	fi, err := os.Lstat(path)
	if err != nil {
		return nil, fsError(err, path)
	}
	return toEntry(path, fi, names), nil
}

// fsError maps an os error to a Connect error.
func fsError(err error, path string) error {
	switch {
	case errors.Is(err, fs.ErrNotExist):
		return connect.NewError(connect.CodeNotFound, fmt.Errorf("path '%s' does not exist", path))
	case errors.Is(err, fs.ErrPermission):
		return connect.NewError(connect.CodePermissionDenied, fmt.Errorf("permission denied: %s", path))
	case errors.Is(err, syscall.ENOTDIR):
		return connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("a component of path '%s' is not a directory", path))
	case errors.Is(err, syscall.ENOSPC), errors.Is(err, syscall.EDQUOT):
		return connect.NewError(connect.CodeResourceExhausted, fmt.Errorf("not enough disk space: %s", path))
	case errors.Is(err, syscall.ELOOP):
		return connect.NewError(connect.CodeFailedPrecondition, fmt.Errorf("too many levels of symbolic links: %s", path))
	default:
		return connect.NewError(connect.CodeInternal, err)
	}
}

// MkdirAllOwned creates dir and any missing parents, chowning each created directory to uid:gid.
func MkdirAllOwned(dir string, uid, gid int) error {
	fi, err := os.Stat(dir)
	if err == nil {
		if !fi.IsDir() {
			return &fs.PathError{Op: "mkdir", Path: dir, Err: syscall.ENOTDIR}
		}
		return nil
	}
	if !errors.Is(err, fs.ErrNotExist) {
		return err
	}
	if parent := filepath.Dir(dir); parent != dir {
		if err := MkdirAllOwned(parent, uid, gid); err != nil {
			return err
		}
	}
	if err := os.Mkdir(dir, 0o755); err != nil {
		if errors.Is(err, fs.ErrExist) {
			return nil
		}
		return err
	}
	if os.Geteuid() == 0 {
		_ = os.Lchown(dir, uid, gid)
	}
	return nil
}
