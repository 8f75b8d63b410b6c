package image

import (
	"errors"
	"fmt"
	"os"
	"strings"
)

// Transport says where an image comes from, named with skopeo's prefixes.
type Transport string

const (
	Registry      Transport = "docker"         // bare reference or docker://
	OCILayout     Transport = "oci"            // oci:PATH[:TAG]
	OCIArchive    Transport = "oci-archive"    // oci-archive:PATH[:TAG]
	DockerArchive Transport = "docker-archive" // docker-archive:PATH[:REF]
)

// ErrBadReference marks an image reference that cannot be parsed.
var ErrBadReference = errors.New("bad image reference")

// Source is a parsed image reference.
type Source struct {
	Transport Transport
	// Path is the layout directory or archive file (local transports).
	Path string
	// Ref is the registry reference (Registry), or the optional tag or
	// reference that selects one image inside a layout or archive.
	Ref string
}

func (s Source) String() string {
	switch {
	case s.Transport == Registry:
		return s.Ref
	case s.Ref != "":
		return string(s.Transport) + ":" + s.Path + ":" + s.Ref
	default:
		return string(s.Transport) + ":" + s.Path
	}
}

// ParseReference parses skopeo-style references: "oci:PATH[:TAG]",
// "oci-archive:PATH[:TAG]", "docker-archive:PATH[:REF]", "docker://REF" and
// a bare registry reference ("ubuntu:22.04", "127.0.0.1:5000/x@sha256:...").
// For the local transports the longest prefix that exists on disk is the
// path, so paths containing ':' work; what follows it is the tag.
func ParseReference(s string) (Source, error) {
	if s == "" {
		return Source{}, fmt.Errorf("%w: empty", ErrBadReference)
	}
	for _, t := range []Transport{OCIArchive, OCILayout, DockerArchive} {
		rest, ok := strings.CutPrefix(s, string(t)+":")
		if !ok {
			continue
		}
		p, tag := splitPathTag(rest)
		if p == "" {
			return Source{}, fmt.Errorf("%w: %q has no path", ErrBadReference, s)
		}
		return Source{Transport: t, Path: p, Ref: tag}, nil
	}
	ref := strings.TrimPrefix(s, "docker://")
	if ref == "" || strings.ContainsAny(ref, " \t\n") {
		return Source{}, fmt.Errorf("%w: %q", ErrBadReference, s)
	}
	return Source{Transport: Registry, Ref: ref}, nil
}

// splitPathTag splits "PATH[:TAG]", preferring the longest existing path.
func splitPathTag(s string) (string, string) {
	if _, err := os.Stat(s); err == nil {
		return s, ""
	}
	for i := strings.LastIndexByte(s, ':'); i > 0; i = strings.LastIndexByte(s[:i], ':') {
		if _, err := os.Stat(s[:i]); err == nil {
			return s[:i], s[i+1:]
		}
	}
	// Nothing exists: the path is everything up to the first ':' (skopeo's
	// rule), so the caller reports a missing path rather than a missing tag.
	if i := strings.IndexByte(s, ':'); i > 0 {
		return s[:i], s[i+1:]
	}
	return s, ""
}
