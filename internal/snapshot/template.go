package snapshot

import (
	"context"
	"fmt"
	"slices"

	"github.com/aenv-dev/aenv/internal/catalog"
	"github.com/aenv-dev/aenv/internal/repository"
)

// ManifestFromTemplate describes a catalog entry (as the orchestrator or
// the template builder registered it) for Publish: its layers are the
// sealed layer files its artifact names (objects with an absolute "path"
// and a "uuid", as stack.LayerRef encodes them), bottom first, and for a
// snapshot the other blobs it names (a microVM's memory image). An entry
// whose artifact names no layer file (a directory template) cannot be
// published and is ErrInvalid.
func ManifestFromTemplate(t catalog.Template, envdVersion string) (Manifest, error) {
	files, err := ArtifactLayers(t.Artifact)
	if err != nil {
		return Manifest{}, err
	}
	if t.Kind != catalog.KindSnapshot {
		// A template's sandboxes boot its filesystem: the memory image of the capture a
		// build came from (a microVM's) is of no use to them and not published.
		files = slices.DeleteFunc(files, func(l LayerFile) bool { return l.Role != "" })
	}
	if len(files) == 0 {
		return Manifest{}, fmt.Errorf("%w: %s %s has no sealed layers to publish", ErrInvalid, t.Kind, t.ID)
	}
	m := Manifest{
		ID: t.ID, Kind: repository.KindTemplate, Layers: files,
		Resources: repository.Resources{CPUCount: t.Resources.CPUCount, MemoryMB: t.Resources.MemoryMB, DiskSizeMB: t.Resources.DiskSizeMB},
		Config: Defaults{EnvVars: t.EnvVars, StartCmd: t.StartCmd, ReadyCmd: t.ReadyCmd, DefaultUser: t.DefaultUser,
			DefaultWorkdir: t.DefaultWorkdir, EnvdAccessToken: t.EnvdAccessToken, Artifact: t.Artifact},
		EnvdVersion: envdVersion, Backend: t.Backend, SourceSandbox: t.SourceSandboxID, ParentSnapshot: t.ParentID,
		CreatedAt: t.CreatedAt,
	}
	if t.Kind == catalog.KindSnapshot {
		m.Kind = repository.KindSnapshot
	}
	if len(t.Aliases) > 0 {
		m.Name = t.Aliases[0]
	}
	return m, nil
}

// PublishTemplate publishes a catalog entry as registered (see
// ManifestFromTemplate): the call the orchestrator makes after it put a new
// snapshot in the catalog, and the template builder after a build.
func (p *Publisher) PublishTemplate(ctx context.Context, t catalog.Template, envdVersion string) (*Handle, error) {
	m, err := ManifestFromTemplate(t, envdVersion)
	if err != nil {
		return nil, err
	}
	return p.Publish(ctx, m)
}
