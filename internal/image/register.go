package image

import (
	"encoding/json"
	"fmt"
	"strings"

	"github.com/aenv-dev/aenv/internal/catalog"
	"github.com/aenv-dev/aenv/internal/sandbox"
)

// TemplateStore is where Register puts templates (*catalog.Templates).
type TemplateStore interface {
	Put(t catalog.Template) error
}

// RegisterOptions describe the catalog entry made for a built image.
type RegisterOptions struct {
	ID        string // required
	Alias     string // the template's name; optional
	Resources sandbox.Resources
	StartCmd  string
	ReadyCmd  string
	// StartFromImage derives the start command from the image's ENTRYPOINT
	// and CMD when StartCmd is empty. Off by default: many images' entrypoint
	// is an init (s6, tini) or a one-shot tool, not a service.
	StartFromImage bool
	// User is the template's default user, an account of the image; default: b.User.
	User string
	// Overlaybd is the converted layer stack, when the image was converted
	// (stored in the artifact: what makes the template layered).
	Overlaybd *catalog.LayerStack
}

// Artifact is what a pulled template's catalog Artifact holds.
type Artifact struct {
	Kind      string              `json:"kind"` // ArtifactKind
	Source    string              `json:"source"`
	Digest    string              `json:"digest"`
	Config    Config              `json:"config"`
	Layers    []Layer             `json:"layers"`
	UserUID   int                 `json:"userUID"`
	Overlaybd *catalog.LayerStack `json:"overlaybd,omitempty"`
}

// ArtifactKind marks catalog templates made from OCI images.
const ArtifactKind = "oci-image"

// Register records b in the catalog as a template whose root filesystem is
// b.RootFS. Environment, working directory and (optionally) the start
// command come from the image configuration.
func Register(ts TemplateStore, b *Built, o RegisterOptions) (catalog.Template, error) {
	if o.ID == "" {
		return catalog.Template{}, fmt.Errorf("%w: template id is required", catalog.ErrInvalid)
	}
	cfg := b.Image.Config
	art, err := json.Marshal(Artifact{Kind: ArtifactKind, Source: b.Image.Source.String(), Digest: b.Image.Digest,
		Config: cfg, Layers: b.Image.Layers, UserUID: b.UserUID, Overlaybd: o.Overlaybd})
	if err != nil {
		return catalog.Template{}, err
	}
	t := catalog.Template{
		ID:             o.ID,
		Kind:           catalog.KindTemplate,
		RootFSDir:      b.RootFS,
		Resources:      o.Resources,
		EnvVars:        EnvMap(cfg.Env),
		StartCmd:       o.StartCmd,
		ReadyCmd:       o.ReadyCmd,
		DefaultUser:    b.User,
		DefaultWorkdir: cfg.WorkingDir,
		ExposedPorts:   cfg.ExposedPorts,
		Labels:         cfg.Labels,
		Entrypoint:     cfg.Entrypoint,
		Cmd:            cfg.Cmd,
		Artifact:       art,
	}
	if o.User != "" {
		t.DefaultUser = o.User
	}
	if t.DefaultWorkdir == "" {
		// The home of the account made sure to exist, whatever the default user: builds
		// start there too.
		t.DefaultWorkdir = "/home/" + b.User
	}
	if o.Alias != "" && o.Alias != o.ID {
		t.Aliases = []string{o.Alias}
	}
	if t.StartCmd == "" && o.StartFromImage {
		t.StartCmd = ShellJoin(append(append([]string{}, cfg.Entrypoint...), cfg.Cmd...))
	}
	if err := ts.Put(t); err != nil {
		return catalog.Template{}, err
	}
	return t, nil
}

// EnvMap turns KEY=VALUE pairs into a map (later entries win).
func EnvMap(env []string) map[string]string {
	if len(env) == 0 {
		return nil
	}
	m := make(map[string]string, len(env))
	for _, kv := range env {
		k, v, _ := strings.Cut(kv, "=")
		if k != "" {
			m[k] = v
		}
	}
	return m
}

// ShellJoin quotes argv for /bin/sh -c.
func ShellJoin(argv []string) string {
	q := make([]string, len(argv))
	for i, a := range argv {
		if a != "" && strings.Trim(a, "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_./=:,+@%") == "" {
			q[i] = a
			continue
		}
		q[i] = "'" + strings.ReplaceAll(a, "'", `'"'"'`) + "'"
	}
	return strings.Join(q, " ")
}
