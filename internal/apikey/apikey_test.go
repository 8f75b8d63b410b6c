package apikey

import (
	"context"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/aenv-dev/aenv/internal/catalog"
)

func openStore(t *testing.T) *catalog.APIKeys {
	t.Helper()
	c, err := catalog.Open(filepath.Join(t.TempDir(), "aenv.db"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c.APIKeys()
}

func TestGenerateFormat(t *testing.T) {
	re := regexp.MustCompile(`^e2b_[0-9a-f]{40}$`)
	seen := map[string]bool{}
	for range 50 {
		k, err := Generate()
		if err != nil {
			t.Fatal(err)
		}
		if !re.MatchString(k) || !E2BCompatible(k) {
			t.Fatalf("key %q does not match e2b_ + 40 hex", k)
		}
		if seen[k] {
			t.Fatalf("duplicate key %q", k)
		}
		seen[k] = true
	}
	if Hash("e2b_x") == "e2b_x" || len(Hash("e2b_x")) != 64 {
		t.Fatalf("Hash is not a sha256 hex digest: %q", Hash("e2b_x"))
	}
	if E2BCompatible("e2b_ABC") || E2BCompatible("key_abc") {
		t.Fatal("E2BCompatible accepts keys the Python SDK rejects")
	}
}

func TestBootstrapGeneratesOnceAndWritesFile(t *testing.T) {
	s := openStore(t)
	dir := filepath.Join(t.TempDir(), "data")
	b, err := Bootstrap(context.Background(), s, dir, "")
	if err != nil {
		t.Fatal(err)
	}
	if !b.Created || b.Path != filepath.Join(dir, AdminKeyFile) {
		t.Fatalf("first start: %+v", b)
	}
	st, err := os.Stat(b.Path)
	if err != nil {
		t.Fatal(err)
	}
	if st.Mode().Perm() != 0o600 {
		t.Fatalf("admin.key mode = %v, want 0600", st.Mode().Perm())
	}
	raw, _ := os.ReadFile(b.Path)
	key := strings.TrimSpace(string(raw))
	v := NewVerifier(s)
	if ok, err := v.Authenticate(context.Background(), key); !ok || err != nil {
		t.Fatalf("generated key does not authenticate: %v %v", ok, err)
	}
	keys, _ := s.List()
	for _, k := range keys {
		if k.Hash == key || strings.Contains(k.Hash, key) {
			t.Fatal("the catalog stores the plaintext key")
		}
	}

	b2, err := Bootstrap(context.Background(), s, dir, "")
	if err != nil {
		t.Fatal(err)
	}
	if b2.Created {
		t.Fatal("second start generated another key")
	}
	raw2, _ := os.ReadFile(b.Path)
	if string(raw2) != string(raw) {
		t.Fatal("second start rewrote admin.key")
	}
	if keys2, _ := s.List(); len(keys2) != 1 {
		t.Fatalf("keys after restart = %d, want 1", len(keys2))
	}
}

func TestBootstrapExplicitKey(t *testing.T) {
	s := openStore(t)
	dir := t.TempDir()
	const key = "e2b_00112233445566778899aabbccddeeff00112233"
	for range 2 { // idempotent across restarts
		b, err := Bootstrap(context.Background(), s, dir, key)
		if err != nil {
			t.Fatal(err)
		}
		if !b.Explicit || b.Created || b.Path != "" {
			t.Fatalf("explicit: %+v", b)
		}
	}
	if _, err := os.Stat(filepath.Join(dir, AdminKeyFile)); !os.IsNotExist(err) {
		t.Fatal("an explicit key must not be written to admin.key")
	}
	v := NewVerifier(s)
	if ok, _ := v.Authenticate(context.Background(), key); !ok {
		t.Fatal("explicit key does not authenticate")
	}
	if _, err := Bootstrap(context.Background(), s, dir, "short"); err == nil {
		t.Fatal("a too-short explicit key was accepted")
	}
}

func TestBootstrapReusesKeyFileForEmptyCatalog(t *testing.T) {
	s := openStore(t)
	dir := t.TempDir()
	const key = "e2b_ffeeddccbbaa99887766554433221100ffeeddcc"
	if err := WriteKeyFile(filepath.Join(dir, AdminKeyFile), key); err != nil {
		t.Fatal(err)
	}
	b, err := Bootstrap(context.Background(), s, dir, "")
	if err != nil {
		t.Fatal(err)
	}
	if b.Created {
		t.Fatal("generated a new key although admin.key held one")
	}
	if ok, _ := NewVerifier(s).Authenticate(context.Background(), key); !ok {
		t.Fatal("key from admin.key was not registered")
	}
}

func TestVerifier(t *testing.T) {
	s := openStore(t)
	key, rec, err := s.Create("ci")
	if err != nil {
		t.Fatal(err)
	}
	v := NewVerifier(s)
	tests := []struct {
		name string
		key  string
		want bool
	}{
		{"valid", key, true},
		{"empty", "", false},
		{"unknown", "e2b_0000000000000000000000000000000000000000", false},
		{"prefix only", key[:10], false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ok, err := v.Authenticate(context.Background(), tt.key)
			if err != nil || ok != tt.want {
				t.Fatalf("Authenticate = %v, %v; want %v", ok, err, tt.want)
			}
		})
	}
	if _, err := s.Revoke(rec.ID); err != nil {
		t.Fatal(err)
	}
	if ok, _ := v.Authenticate(context.Background(), key); ok {
		t.Fatal("revoked key still authenticates")
	}
}
