package build

import (
	"fmt"

	"github.com/aenv-dev/aenv/internal/image"
)

// pullOptions are the node's pull options with the request's registry credentials,
// which apply to fromImage's registry only.
func (s *Service) pullOptions(spec Spec, logf func(level, msg string)) (image.Options, error) {
	o := s.cfg.Pull
	if spec.Force {
		logf("info", "force: every step runs (no step cache) and the image tag is resolved again")
	}
	if spec.Registry == nil {
		return o, nil
	}
	kc, err := image.CredentialsKeychain(spec.FromImage, *spec.Registry, o.Keychain)
	if err != nil {
		return o, fmt.Errorf("registry credentials: %w", err)
	}
	o.Keychain = kc
	logf("info", "using the registry credentials given with the build (user "+spec.Registry.Username+")")
	return o, nil
}
