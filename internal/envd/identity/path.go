package identity

import (
	"path/filepath"
	"strings"
)

// Resolve turns a request path into an absolute, cleaned path for user u (E2B's ExpandAndResolve):
// "" is the default workdir (or the home when none is set), "~" and "~/x" are under the home,
// relative paths are joined to the home, absolute paths are kept.
func Resolve(p string, u *User, defaultWorkdir string) string {
	home := u.Home
	if home == "" {
		home = "/"
	}
	switch {
	case p == "":
		if defaultWorkdir != "" {
			return filepath.Clean(defaultWorkdir)
		}
		return filepath.Clean(home)
	case p == "~":
		return filepath.Clean(home)
	case strings.HasPrefix(p, "~/"):
		return filepath.Join(home, p[2:])
	case filepath.IsAbs(p):
		return filepath.Clean(p)
	default:
		return filepath.Join(home, p)
	}
}
