package image

import "github.com/google/go-containerregistry/pkg/authn"

type basicAuth struct{ user, pass string }

func (b *basicAuth) Authorization() (*authn.AuthConfig, error) {
	return &authn.AuthConfig{Username: b.user, Password: b.pass}, nil
}
