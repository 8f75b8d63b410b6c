package image

import (
	"context"
	"fmt"
	"os"

	"github.com/docker/cli/cli/config"
	"github.com/docker/cli/cli/config/types"
	"github.com/google/go-containerregistry/pkg/authn"
	"github.com/google/go-containerregistry/pkg/name"
)

// fileKeychain reads credentials from one docker config file (auths,
// credential helpers), the way authn.DefaultKeychain reads the default one.
type fileKeychain struct{ path string }

func (k fileKeychain) Resolve(r authn.Resource) (authn.Authenticator, error) {
	return k.ResolveContext(context.Background(), r)
}

func (k fileKeychain) ResolveContext(_ context.Context, r authn.Resource) (authn.Authenticator, error) {
	f, err := os.Open(k.path)
	if err != nil {
		return nil, fmt.Errorf("docker config: %w", err)
	}
	defer f.Close()
	cf, err := config.LoadFromReader(f)
	if err != nil {
		return nil, fmt.Errorf("docker config %s: %w", k.path, err)
	}
	var empty types.AuthConfig
	for _, key := range []string{r.String(), r.RegistryStr()} {
		if key == name.DefaultRegistry {
			key = authn.DefaultAuthKey
		}
		ac, err := cf.GetAuthConfig(key)
		if err != nil {
			return nil, fmt.Errorf("docker config %s: %w", k.path, err)
		}
		ac.ServerAddress = ""
		if ac != empty {
			return authn.FromConfig(authn.AuthConfig{Username: ac.Username, Password: ac.Password,
				Auth: ac.Auth, IdentityToken: ac.IdentityToken, RegistryToken: ac.RegistryToken}), nil
		}
	}
	return authn.Anonymous, nil
}
