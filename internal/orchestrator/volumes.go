package orchestrator

import (
	"fmt"
	"maps"
	"path"
	"slices"
	"strings"

	"github.com/aenv-dev/aenv/internal/catalog"
	"github.com/aenv-dev/aenv/internal/sandbox"
)

// Volumes gives the host directory of a volume that owner may mount (the node's volume
// store). An unknown volume, or one of another owner, is an error naming it.
type Volumes interface {
	MountDir(owner, volumeID string) (string, error)
}

// Secrets expands ${e2b.secrets.<name>} placeholders with owner's secrets (the node's
// secret store). Errors name the secret, never a value.
type Secrets interface {
	Expand(owner, value string) (string, error)
}

// WithVolumes lets sandboxes mount the node's volumes.
func WithVolumes(v Volumes) Option { return func(o *Orchestrator) { o.volumes = v } }

// WithSecrets lets sandboxes' environment refer to the node's secrets.
func WithSecrets(s Secrets) Option { return func(o *Orchestrator) { o.secrets = s } }

// MaxVolumeMounts bounds the volumes of one sandbox.
const MaxVolumeMounts = 16

// reservedMountPaths are where a volume may not go: the kernel's and the runtime's
// filesystems, and envd.
var reservedMountPaths = []string{"/proc", "/sys", "/dev", "/.aenv", "/etc/resolv.conf", "/etc/hosts", "/etc/hostname"}

// ValidMountPath checks a volume's mount path inside a sandbox.
func ValidMountPath(p string) error {
	if !strings.HasPrefix(p, "/") || path.Clean(p) != p || p == "/" || strings.ContainsRune(p, 0) {
		return fmt.Errorf("%w: volume mount path %q must be an absolute, clean path other than /", ErrInvalid, p)
	}
	for _, r := range reservedMountPaths {
		if p == r || strings.HasPrefix(p, r+"/") {
			return fmt.Errorf("%w: volume mount path %q is inside %s, which the sandbox runtime owns", ErrInvalid, p, r)
		}
	}
	return nil
}

// resolveMounts merges the volumes a snapshot template recorded with the request's (the
// request wins on the same path), checks them and returns them with their host
// directories. A backend that cannot mount volumes is refused here, before anything starts.
func (o *Orchestrator) resolveMounts(owner string, req []VolumeMount, tpl catalog.Template) ([]VolumeMount, []sandbox.Mount, error) {
	want := slices.Clone(req)
	for _, t := range tpl.VolumeMounts {
		if !slices.ContainsFunc(want, func(m VolumeMount) bool { return m.Path == t.Path }) {
			want = append(want, t)
		}
	}
	if len(want) == 0 {
		return nil, nil, nil
	}
	if len(want) > MaxVolumeMounts {
		return nil, nil, fmt.Errorf("%w: %d volume mounts; the limit is %d", ErrInvalid, len(want), MaxVolumeMounts)
	}
	if m, ok := o.backend.(sandbox.VolumeMounter); !ok || !m.MountsVolumes() {
		// A 400, not a 501: the request cannot be served on this node as it is, and
		// the client must drop its volumeMounts (or use an oci node), not retry.
		return nil, nil, fmt.Errorf("%w: %w: backend %s cannot mount volumes (volumes need the oci backend)", ErrInvalid, ErrUnsupported, o.backend.Name())
	}
	if o.volumes == nil {
		return nil, nil, fmt.Errorf("%w: this node has no volume store", ErrUnsupported)
	}
	seen := map[string]bool{}
	mounts := make([]sandbox.Mount, 0, len(want))
	for _, v := range want {
		if err := ValidMountPath(v.Path); err != nil {
			return nil, nil, err
		}
		if seen[v.Path] {
			return nil, nil, fmt.Errorf("%w: two volumes mounted at %s", ErrInvalid, v.Path)
		}
		seen[v.Path] = true
		dir, err := o.volumes.MountDir(owner, v.VolumeID)
		if err != nil {
			return nil, nil, fmt.Errorf("%w: volume %q (%s): %w", ErrInvalid, v.Name, v.VolumeID, err)
		}
		mounts = append(mounts, sandbox.Mount{Source: dir, Destination: v.Path})
	}
	return want, mounts, nil
}

// sandboxEnv is the environment envd gets: the template's, the sandbox's own over it, with
// secret placeholders expanded in the sandbox owner's scope.
func (o *Orchestrator) sandboxEnv(rec *Sandbox) (map[string]string, error) {
	env := maps.Clone(rec.Launch.TemplateEnvVars)
	if env == nil {
		env = map[string]string{}
	}
	maps.Copy(env, rec.EnvVars)
	if o.secrets == nil {
		return env, nil
	}
	for k, v := range env {
		if !strings.Contains(v, "${e2b.secrets.") {
			continue
		}
		x, err := o.secrets.Expand(rec.Owner, v)
		if err != nil {
			return nil, fmt.Errorf("%w: environment variable %s: %w", ErrInvalid, k, err)
		}
		env[k] = x
	}
	return env, nil
}

// expandRules returns rules with secret placeholders in header values expanded in owner's
// scope (a copy: the record's rules keep the placeholders).
func (o *Orchestrator) expandRules(owner string, rules map[string][]sandbox.Transform) (map[string][]sandbox.Transform, error) {
	if o.secrets == nil || len(rules) == 0 {
		return rules, nil
	}
	out := make(map[string][]sandbox.Transform, len(rules))
	for host, list := range rules {
		ts := make([]sandbox.Transform, len(list))
		for i, t := range list {
			if t.Headers == nil {
				continue
			}
			ts[i].Headers = make(map[string]string, len(t.Headers))
			for k, v := range t.Headers {
				if strings.Contains(v, "${e2b.secrets.") {
					x, err := o.secrets.Expand(owner, v)
					if err != nil {
						return nil, fmt.Errorf("%w: network.rules[%s] header %s: %w", ErrInvalid, host, k, err)
					}
					v = x
				}
				ts[i].Headers[k] = v
			}
		}
		out[host] = ts
	}
	return out, nil
}
