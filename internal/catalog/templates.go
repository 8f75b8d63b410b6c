package catalog

import (
	"encoding/json"
	"fmt"
	"regexp"
	"slices"
	"sort"
	"time"

	bolt "go.etcd.io/bbolt"

	"github.com/aenv-dev/aenv/internal/sandbox"
)

// TemplateKind distinguishes what a sandbox can be created from. Both kinds are
// accepted as templateID on create (E2B treats snapshot ids as template ids).
type TemplateKind string

const (
	KindTemplate TemplateKind = "template" // built from an image or a directory
	KindSnapshot TemplateKind = "snapshot" // captured from a running sandbox
)

// namePattern constrains ids and aliases: they appear in URL paths
// (/templates/{id}, /templates/aliases/{alias}) and in host names, so no separators.
var namePattern = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$`)

// ValidName reports whether s can be a template id or alias.
func ValidName(s string) bool { return namePattern.MatchString(s) }

// Template is something sandboxes are created from.
type Template struct {
	ID   string       `json:"id"`
	Kind TemplateKind `json:"kind"`
	// Aliases are the E2B names of the template; each resolves to this id.
	Aliases []string `json:"aliases,omitempty"`
	// RootFSDir is an unpacked root filesystem used read-only as the lower of each
	// sandbox's overlay (directory templates). Empty for other storage kinds.
	RootFSDir string `json:"rootfsDir,omitempty"`
	// Resources are the defaults for sandboxes that do not ask for their own.
	Resources sandbox.Resources `json:"resources"`
	EnvVars   map[string]string `json:"envVars,omitempty"`
	StartCmd  string            `json:"startCmd,omitempty"`
	ReadyCmd  string            `json:"readyCmd,omitempty"`
	// DefaultUser and DefaultWorkdir are handed to envd at init; empty means the E2B
	// defaults (user, /home/user).
	DefaultUser    string `json:"defaultUser,omitempty"`
	DefaultWorkdir string `json:"defaultWorkdir,omitempty"`
	// ExposedPorts ("80", "53/udp"), Labels, Entrypoint and Cmd are the image
	// configuration a template was made from, with a build's EXPOSE and LABEL added:
	// kept so clients can read what the image declares (nothing here acts on them).
	ExposedPorts []string          `json:"exposedPorts,omitempty"`
	Labels       map[string]string `json:"labels,omitempty"`
	Entrypoint   []string          `json:"entrypoint,omitempty"`
	Cmd          []string          `json:"cmd,omitempty"`
	// SourceSandboxID is the sandbox a snapshot was captured from.
	SourceSandboxID string `json:"sourceSandboxID,omitempty"`
	// ParentID is the snapshot the source sandbox was itself created from (lineage:
	// snapshot chains share layers); empty for snapshots of template-born sandboxes.
	ParentID string `json:"parentID,omitempty"`
	// Backend is the sandbox backend whose capture Artifact holds: a snapshot (its memory
	// image, its capture) launches only on that backend, and nodes of another kind refuse
	// it; a template built from a capture records the backend the build ran on, but its
	// sandboxes boot its filesystem (the layer stack) on any backend.
	Backend string `json:"backend,omitempty"`
	// EnvdAccessToken is, for a snapshot, the envd token of its source sandbox, which
	// envd holds in a captured memory: re-initialising envd in a sandbox restored from it
	// needs it (and replaces it). It travels with the snapshot to other nodes, as the
	// memory image that holds it does.
	EnvdAccessToken string `json:"envdAccessToken,omitempty"`
	// Artifact is an opaque description owned by the storage engine or backend (layer
	// stack, captured snapshot state); the catalog stores it verbatim.
	Artifact  json.RawMessage `json:"artifact,omitempty"`
	CreatedAt time.Time       `json:"createdAt"`
	// VolumeMounts are the volumes a snapshot's source mounted (which volumes, not their
	// content): sandboxes created from the snapshot mount them again.
	VolumeMounts []VolumeMount `json:"volumeMounts,omitempty"`
}

// VolumeMount is a named volume mounted at Path (E2B's SandboxVolumeMount plus the id).
type VolumeMount struct {
	Name     string `json:"name"`
	Path     string `json:"path"`
	VolumeID string `json:"volumeID"`
}

// Templates stores templates and snapshots with an alias index.
type Templates struct{ db *bolt.DB }

func (t Template) validate() error {
	if !ValidName(t.ID) {
		return fmt.Errorf("%w: template id %q must match %s", ErrInvalid, t.ID, namePattern)
	}
	switch t.Kind {
	case KindTemplate, KindSnapshot:
	default:
		return fmt.Errorf("%w: template %q has kind %q (want %q or %q)", ErrInvalid, t.ID, t.Kind, KindTemplate, KindSnapshot)
	}
	for _, a := range t.Aliases {
		if !ValidName(a) {
			return fmt.Errorf("%w: alias %q must match %s", ErrInvalid, a, namePattern)
		}
	}
	r := t.Resources
	if r.CPUCount < 0 || r.MemoryMB < 0 || r.DiskSizeMB < 0 {
		return fmt.Errorf("%w: template %q has negative resources", ErrInvalid, t.ID)
	}
	return nil
}

// Put creates or replaces a template. Aliases must not belong to another template or
// equal another template's id (ErrAliasTaken); aliases the old version had and the new
// one lacks are released. A zero CreatedAt keeps the stored one, or is set to now, so
// re-registering a template at every start does not change its age.
func (s *Templates) Put(t Template) error {
	if err := t.validate(); err != nil {
		return err
	}
	t.Aliases = slices.Compact(slices.Sorted(slices.Values(t.Aliases)))
	return wrap("put template", s.db.Update(func(tx *bolt.Tx) error {
		tb, ab := tx.Bucket(bucketTemplates), tx.Bucket(bucketTemplateAliases)
		if owner := ab.Get([]byte(t.ID)); owner != nil && string(owner) != t.ID {
			return fmt.Errorf("%w: id %q is an alias of template %q", ErrAliasTaken, t.ID, owner)
		}
		for _, a := range t.Aliases {
			if owner := ab.Get([]byte(a)); owner != nil && string(owner) != t.ID {
				return fmt.Errorf("%w: %q belongs to template %q", ErrAliasTaken, a, owner)
			}
			if a != t.ID && tb.Get([]byte(a)) != nil {
				return fmt.Errorf("%w: %q is the id of another template", ErrAliasTaken, a)
			}
		}
		if old := tb.Get([]byte(t.ID)); old != nil {
			var prev Template
			if err := json.Unmarshal(old, &prev); err != nil {
				return fmt.Errorf("decode template %q: %w", t.ID, err)
			}
			for _, a := range prev.Aliases {
				if !slices.Contains(t.Aliases, a) {
					if err := ab.Delete([]byte(a)); err != nil {
						return err
					}
				}
			}
			if t.CreatedAt.IsZero() {
				t.CreatedAt = prev.CreatedAt
			}
		}
		if t.CreatedAt.IsZero() {
			t.CreatedAt = time.Now().UTC()
		}
		raw, err := json.Marshal(t)
		if err != nil {
			return fmt.Errorf("encode template: %w", err)
		}
		for _, a := range t.Aliases {
			if err := ab.Put([]byte(a), []byte(t.ID)); err != nil {
				return err
			}
		}
		return tb.Put([]byte(t.ID), raw)
	}))
}

// Get returns the template with exactly this id, or ErrNotFound.
func (s *Templates) Get(id string) (Template, error) {
	var t Template
	err := s.db.View(func(tx *bolt.Tx) error {
		var err error
		t, err = getTemplate(tx, id)
		return err
	})
	return t, wrap("get template", err)
}

// Resolve finds a template by id or alias, the way create's templateID is interpreted.
func (s *Templates) Resolve(idOrAlias string) (Template, error) {
	var t Template
	err := s.db.View(func(tx *bolt.Tx) error {
		var err error
		t, err = resolveTemplate(tx, idOrAlias)
		return err
	})
	return t, wrap("resolve template", err)
}

// List returns templates of the given kind (all kinds when kind is empty), oldest first.
func (s *Templates) List(kind TemplateKind) ([]Template, error) {
	var out []Template
	err := s.db.View(func(tx *bolt.Tx) error {
		return tx.Bucket(bucketTemplates).ForEach(func(k, v []byte) error {
			var t Template
			if err := json.Unmarshal(v, &t); err != nil {
				return fmt.Errorf("decode template %q: %w", k, err)
			}
			if kind == "" || t.Kind == kind {
				out = append(out, t)
			}
			return nil
		})
	})
	sort.SliceStable(out, func(i, j int) bool { return out[i].CreatedAt.Before(out[j].CreatedAt) })
	return out, wrap("list templates", err)
}

// Delete removes a template (by id or alias) and its aliases and returns what it removed.
func (s *Templates) Delete(idOrAlias string) (Template, error) {
	var t Template
	err := s.db.Update(func(tx *bolt.Tx) error {
		var err error
		if t, err = resolveTemplate(tx, idOrAlias); err != nil {
			return err
		}
		ab := tx.Bucket(bucketTemplateAliases)
		for _, a := range t.Aliases {
			if err := ab.Delete([]byte(a)); err != nil {
				return err
			}
		}
		return tx.Bucket(bucketTemplates).Delete([]byte(t.ID))
	})
	return t, wrap("delete template", err)
}

func getTemplate(tx *bolt.Tx, id string) (Template, error) {
	var t Template
	v := tx.Bucket(bucketTemplates).Get([]byte(id))
	if v == nil {
		return t, fmt.Errorf("template %q: %w", id, ErrNotFound)
	}
	if err := json.Unmarshal(v, &t); err != nil {
		return t, fmt.Errorf("decode template %q: %w", id, err)
	}
	return t, nil
}

func resolveTemplate(tx *bolt.Tx, idOrAlias string) (Template, error) {
	if idOrAlias == "" {
		return Template{}, fmt.Errorf("empty template name: %w", ErrNotFound)
	}
	t, err := getTemplate(tx, idOrAlias)
	if err == nil {
		return t, nil
	}
	if id := tx.Bucket(bucketTemplateAliases).Get([]byte(idOrAlias)); id != nil {
		return getTemplate(tx, string(id))
	}
	return Template{}, err
}
