package stack

import (
	"encoding/json"
	"fmt"
	"github.com/aenv-dev/aenv/internal/atomicfile"
	"os"
	"path/filepath"
)

// Manifest describes a stack: sealed lowers (bottom first, as overlaybd's
// image.json) and an optional writable upper. Relative paths resolve against
// Dir, which LoadManifest sets to the manifest file's directory.
type Manifest struct {
	VirtualSize uint64     `json:"virtual_size,omitempty"` // bytes; 0 = from the upper or the top lower
	Lowers      []LayerRef `json:"lowers"`
	Upper       *Upper     `json:"upper,omitempty"`
	// MaxDepth is the lower count above which SealAndRestack compacts the
	// newest lowers into one; 0 means DefaultMaxDepth.
	MaxDepth int    `json:"max_depth,omitempty"`
	Dir      string `json:"-"`
}

// LayerRef names one sealed layer. Path is used when set; otherwise
// Options.Resolver opens the layer by Digest (a remote or cached blob).
type LayerRef struct {
	Path   string `json:"path,omitempty"`
	Digest string `json:"digest,omitempty"`
	Size   int64  `json:"size,omitempty"`
	UUID   string `json:"uuid,omitempty"`
}

// Upper names the writable layer's files; they are created when missing.
type Upper struct {
	Data   string `json:"data"`
	Index  string `json:"index,omitempty"`
	Sparse bool   `json:"sparse,omitempty"`
	Hybrid bool   `json:"hybrid,omitempty"` // overwrite upper-owned data in place
}

// DefaultMaxDepth is the default compaction threshold (AgentENV's limit).
const DefaultMaxDepth = 32

// maxLowers is the format's limit: tags are a u8.
const maxLowers = 255

// LoadManifest reads a JSON manifest and sets its Dir.
func LoadManifest(path string) (*Manifest, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("stack manifest: %w", err)
	}
	m := &Manifest{}
	if err := json.Unmarshal(b, m); err != nil {
		return nil, fmt.Errorf("stack manifest %s: %w", path, err)
	}
	if err := m.validate(); err != nil {
		return nil, fmt.Errorf("stack manifest %s: %w", path, err)
	}
	m.Dir = filepath.Dir(path)
	return m, nil
}

func (m *Manifest) validate() error {
	if len(m.Lowers) > maxLowers {
		return fmt.Errorf("%d lowers, at most %d", len(m.Lowers), maxLowers)
	}
	if m.MaxDepth < 0 || m.MaxDepth >= maxLowers {
		return fmt.Errorf("max_depth %d outside [0, %d)", m.MaxDepth, maxLowers)
	}
	for i, l := range m.Lowers {
		if l.Path == "" && l.Digest == "" {
			return fmt.Errorf("lower %d has neither path nor digest", i)
		}
	}
	if m.Upper != nil && (m.Upper.Data == "" || !m.Upper.Sparse && m.Upper.Index == "") {
		return fmt.Errorf("upper needs data and index paths (or sparse)")
	}
	if m.Upper != nil && m.Upper.Sparse && m.Upper.Hybrid {
		return fmt.Errorf("upper cannot be both sparse and hybrid")
	}
	if m.VirtualSize%512 != 0 {
		return fmt.Errorf("virtual_size %d not a multiple of 512", m.VirtualSize)
	}
	return nil
}

// Save writes m atomically (temp file, fsync, rename).
func (m *Manifest) Save(path string) error {
	b, err := json.MarshalIndent(m, "", "  ")
	if err != nil {
		return err
	}
	if err := atomicfile.WriteFile(path, append(b, '\n'), 0o644); err != nil {
		return fmt.Errorf("save manifest: %w", err)
	}
	return nil
}

func (m *Manifest) abs(p string) string {
	if p == "" || filepath.IsAbs(p) {
		return p
	}
	return filepath.Join(m.Dir, p)
}

func (m *Manifest) clone() Manifest {
	c := *m
	c.Lowers = append([]LayerRef(nil), m.Lowers...)
	if m.Upper != nil {
		u := *m.Upper
		c.Upper = &u
	}
	return c
}
