package remote

import (
	"context"
	"fmt"
	"net/http"
	"time"

	"github.com/google/go-containerregistry/pkg/authn"
	"github.com/google/go-containerregistry/pkg/name"
	"github.com/google/go-containerregistry/pkg/v1/remote/transport"
)

// OpenRegistry opens an OCI registry blob ("host/repo@sha256:...") for
// ranged reads. Authentication (anonymous, basic or bearer token exchange) is
// go-containerregistry's transport; auth nil means anonymous and base nil
// means http.DefaultTransport. Plain HTTP is used for localhost registries
// and when opts include name.Insecure.
func OpenRegistry(ctx context.Context, ref string, auth authn.Authenticator, base http.RoundTripper, opts ...name.Option) (*HTTP, error) {
	d, err := name.NewDigest(ref, opts...)
	if err != nil {
		return nil, fmt.Errorf("remote: blob reference %q: %w", ref, err)
	}
	if auth == nil {
		auth = authn.Anonymous
	}
	if base == nil {
		base = http.DefaultTransport
	}
	repo := d.Context()
	tr, err := transport.NewWithContext(ctx, repo.Registry, auth, base, []string{repo.Scope(transport.PullScope)})
	if err != nil {
		return nil, fmt.Errorf("remote: registry %s: %w", repo.RegistryStr(), err)
	}
	url := fmt.Sprintf("%s://%s/v2/%s/blobs/%s", repo.Scheme(), repo.RegistryStr(), repo.RepositoryStr(), d.DigestStr())
	return OpenHTTP(ctx, url, &http.Client{Transport: tr, Timeout: 30 * time.Second})
}
