package image

import (
	"context"
	"errors"
	"net/http"
	"runtime"
	"testing"

	"github.com/google/go-containerregistry/pkg/authn"
	"github.com/google/go-containerregistry/pkg/name"
	"github.com/google/go-containerregistry/pkg/v1/remote"
)

// TestCredentialsKeychain pulls from a registry that wants basic auth with credentials
// given per request (E2B's fromImageRegistry), and checks they go to that registry only.
func TestCredentialsKeychain(t *testing.T) {
	const user, pass = "bob", "hunter2"
	host := serveRegistry(t, func(next http.Handler) http.Handler {
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if u, p, ok := r.BasicAuth(); !ok || u != user || p != pass {
				w.Header().Set("WWW-Authenticate", `Basic realm="test"`)
				http.Error(w, "unauthorized", http.StatusUnauthorized)
				return
			}
			next.ServeHTTP(w, r)
		})
	})
	r, _ := name.ParseReference(host + "/private:1")
	if err := remote.Write(r, testImage(t, runtime.GOARCH), remote.WithAuth(basic(user, pass))); err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	ref := host + "/private:1"
	for _, tc := range []struct {
		name  string
		creds Credentials
		want  error
	}{
		{"right", Credentials{Username: user, Password: pass}, nil},
		{"wrong password", Credentials{Username: user, Password: "nope"}, ErrUnauthorized},
	} {
		t.Run(tc.name, func(t *testing.T) {
			kc, err := CredentialsKeychain(ref, tc.creds, nil)
			if err != nil {
				t.Fatal(err)
			}
			img, err := Pull(ctx, ref, Options{Keychain: kc})
			if !errors.Is(err, tc.want) || (tc.want == nil && err != nil) {
				t.Fatalf("Pull = %v, want %v", err, tc.want)
			}
			if err == nil {
				defer img.Close()
				if err := (&Store{Dir: t.TempDir()}).Fetch(ctx, img, nil); err != nil {
					t.Fatalf("fetch with credentials: %v", err)
				}
			}
		})
	}
	// The credentials are for that registry only.
	kc, err := CredentialsKeychain(ref, Credentials{Username: user, Password: pass}, nil)
	if err != nil {
		t.Fatal(err)
	}
	other, _ := name.NewRepository("other.example:5000/x")
	if a, err := kc.Resolve(other); err != nil || a != authn.Anonymous {
		t.Errorf("another registry got %v, %v; want anonymous", a, err)
	}
	for _, bad := range []struct {
		ref   string
		creds Credentials
	}{
		{"oci:/some/layout", Credentials{Username: user, Password: pass}},
		{ref, Credentials{Username: user}},
		{"UPPER/case", Credentials{Username: user, Password: pass}},
	} {
		if _, err := CredentialsKeychain(bad.ref, bad.creds, nil); err == nil {
			t.Errorf("CredentialsKeychain(%q, %+v) accepted", bad.ref, bad.creds)
		}
	}
}
