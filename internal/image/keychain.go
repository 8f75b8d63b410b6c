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

// Credentials are a username and password for one registry, as a request
// gives them (E2B's fromImageRegistry "registry" type) rather than a file on
// the node.
type Credentials struct {
	Username string
	Password string
}

// CredentialsKeychain answers with creds for the registry that ref names and
// defers to fallback (nil: anonymous) for every other registry, so
// credentials given for one image are never sent elsewhere.
func CredentialsKeychain(ref string, creds Credentials, fallback authn.Keychain) (authn.Keychain, error) {
	src, err := ParseReference(ref)
	if err != nil {
		return nil, err
	}
	if src.Transport != Registry {
		return nil, fmt.Errorf("%w: registry credentials given for %s, which is not a registry image", ErrUnsupportedSource, src)
	}
	r, err := name.ParseReference(src.Ref)
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrBadReference, err)
	}
	if creds.Username == "" || creds.Password == "" {
		return nil, fmt.Errorf("%w: registry credentials need both a username and a password", ErrBadReference)
	}
	if fallback == nil {
		fallback = anonymousKeychain{}
	}
	return credsKeychain{registry: r.Context().RegistryStr(), creds: creds, fallback: fallback}, nil
}

type credsKeychain struct {
	registry string
	creds    Credentials
	fallback authn.Keychain
}

func (k credsKeychain) Resolve(r authn.Resource) (authn.Authenticator, error) {
	if r.RegistryStr() != k.registry {
		return k.fallback.Resolve(r)
	}
	return authn.FromConfig(authn.AuthConfig{Username: k.creds.Username, Password: k.creds.Password}), nil
}

type anonymousKeychain struct{}

func (anonymousKeychain) Resolve(authn.Resource) (authn.Authenticator, error) {
	return authn.Anonymous, nil
}
