package snapshot

import (
	"bytes"
	"encoding/json"
	"fmt"
	"path/filepath"
	"slices"
	"strings"

	"github.com/aenv-dev/aenv/internal/repository"
)

// Artifacts (a backend's capture, a template's stack) are opaque JSON owned
// by their producers, but every producer in this codebase names sealed
// layers the same way, as objects with the fields of stack.LayerRef:
// {"path", "digest", "size", "uuid"}. The functions here rely on that shape
// and nothing else, so the publisher can make an artifact portable (fill in
// digests on the node that made it, local paths on the node that uses it)
// without knowing which backend wrote it.

func decodeJSON(raw []byte) (any, error) {
	dec := json.NewDecoder(bytes.NewReader(raw))
	dec.UseNumber() // sizes must survive the round trip exactly
	var v any
	if err := dec.Decode(&v); err != nil {
		return nil, fmt.Errorf("%w: artifact is not JSON: %v", ErrInvalid, err)
	}
	return v, nil
}

// walkLayerRefs calls fn for every JSON object that has a "path" or a
// "digest" string; fn may modify it.
func walkLayerRefs(v any, fn func(obj map[string]any)) {
	switch x := v.(type) {
	case map[string]any:
		_, hasPath := x["path"].(string)
		_, hasDigest := x["digest"].(string)
		if hasPath || hasDigest {
			fn(x)
		}
		for _, c := range x {
			walkLayerRefs(c, fn)
		}
	case []any:
		for _, c := range x {
			walkLayerRefs(c, fn)
		}
	}
}

// ArtifactLayers lists the blobs an artifact names: sealed layers, objects
// with a "uuid" (LSMT layers have one), and other blobs, objects with a
// "role" other than "rootfs" (a microVM's "memory" and "vmstate"), each with
// an absolute "path", or no path but a "digest" (a blob this node reads from
// the repository), each once: the layers in document order (bottom first),
// then the other blobs by role.
func ArtifactLayers(raw json.RawMessage) ([]LayerFile, error) {
	if len(raw) == 0 {
		return nil, nil
	}
	v, err := decodeJSON(raw)
	if err != nil {
		return nil, err
	}
	var out []LayerFile
	seen := map[string]bool{}
	walkLayerRefs(v, func(o map[string]any) {
		p, _ := o["path"].(string)
		d, _ := o["digest"].(string)
		uuid, _ := o["uuid"].(string)
		role, _ := o["role"].(string)
		if role == rootRole {
			role = ""
		}
		var l LayerFile
		switch {
		case uuid == "" && role == "":
			return
		case p != "" && filepath.IsAbs(p):
			l = LayerFile{Path: filepath.Clean(p), UUID: uuid}
		case p == "" && repository.Digest(d).Validate() == nil:
			l = LayerFile{Digest: repository.Digest(d), UUID: uuid}
		default:
			return
		}
		l.Role = role
		key := l.Path + "|" + string(l.Digest)
		if seen[key] {
			return
		}
		seen[key] = true
		if n, ok := o["size"].(json.Number); ok {
			l.Size, _ = n.Int64()
		}
		out = append(out, l)
	})
	// Objects are walked in no set order: the other blobs go after the layers, by role.
	slices.SortStableFunc(out, func(a, b LayerFile) int {
		switch {
		case a.Role == b.Role:
			return 0
		case a.Role == "":
			return -1
		case b.Role == "":
			return 1
		}
		return strings.Compare(a.Role, b.Role)
	})
	return out, nil
}

// rewriteArtifact applies fn to every layer ref of raw and re-encodes it.
func rewriteArtifact(raw json.RawMessage, fn func(obj map[string]any)) (json.RawMessage, error) {
	if len(raw) == 0 {
		return raw, nil
	}
	v, err := decodeJSON(raw)
	if err != nil {
		return nil, err
	}
	walkLayerRefs(v, fn)
	return json.Marshal(v)
}

// withDigests fills "digest" in refs whose path is a published layer, so
// another node can find the bytes.
func withDigests(raw json.RawMessage, byPath map[string]repository.Digest) (json.RawMessage, error) {
	return rewriteArtifact(raw, func(o map[string]any) {
		if p, ok := o["path"].(string); ok {
			if d, ok := byPath[filepath.Clean(p)]; ok {
				o["digest"] = string(d)
			}
		}
	})
}

// withPaths points refs with a known digest at this node's copy.
func withPaths(raw json.RawMessage, byDigest map[repository.Digest]string) (json.RawMessage, error) {
	return rewriteArtifact(raw, func(o map[string]any) {
		if d, ok := o["digest"].(string); ok {
			if p, ok := byDigest[repository.Digest(d)]; ok {
				o["path"] = p
			}
		}
	})
}

// withLayerList replaces every JSON array whose elements are exactly the
// refs of old (by digest, in order) with refs to repl: after a compaction
// the artifact's stack must name the merged layer instead of its inputs.
func withLayerList(raw json.RawMessage, old []repository.Digest, repl []layerRef) (json.RawMessage, bool, error) {
	if len(raw) == 0 {
		return raw, false, nil
	}
	v, err := decodeJSON(raw)
	if err != nil {
		return nil, false, err
	}
	replaced := false
	var walk func(v any) any
	walk = func(v any) any {
		switch x := v.(type) {
		case map[string]any:
			for k, c := range x {
				x[k] = walk(c)
			}
		case []any:
			if digestsOf(x) != nil && slices.Equal(digestsOf(x), old) {
				replaced = true
				out := make([]any, len(repl))
				for i, r := range repl {
					out[i] = map[string]any{"path": r.Path, "digest": string(r.Digest), "size": r.Size, "uuid": r.UUID}
				}
				return out
			}
			for i, c := range x {
				x[i] = walk(c)
			}
		}
		return v
	}
	v = walk(v)
	b, err := json.Marshal(v)
	return b, replaced, err
}

// digestsOf returns the digests of an array of layer refs, or nil when an
// element is not a ref with a digest.
func digestsOf(arr []any) []repository.Digest {
	if len(arr) == 0 {
		return nil
	}
	out := make([]repository.Digest, len(arr))
	for i, e := range arr {
		o, ok := e.(map[string]any)
		if !ok {
			return nil
		}
		d, ok := o["digest"].(string)
		if !ok {
			return nil
		}
		out[i] = repository.Digest(d)
	}
	return out
}

// layerRef is a published layer with this node's copy of it.
type layerRef struct {
	Path   string
	Digest repository.Digest
	Size   int64
	UUID   string
}
