package catalog

import (
	"bytes"
	"errors"
	"path/filepath"
	"regexp"
	"testing"
	"time"

	"github.com/aenv-dev/aenv/internal/sandbox"
)

func openTemp(t *testing.T) (*Catalog, string) {
	t.Helper()
	path := filepath.Join(t.TempDir(), "sub", "aenv.db")
	c, err := Open(path)
	if err != nil {
		t.Fatalf("Open: %v", err)
	}
	t.Cleanup(func() { c.Close() })
	return c, path
}

func TestSandboxesPersistAcrossReopen(t *testing.T) {
	c, path := openTemp(t)
	s := c.Sandboxes()
	if err := s.Put("a", []byte(`{"x":1}`)); err != nil {
		t.Fatal(err)
	}
	if err := s.Put("b", []byte(`{"x":2}`)); err != nil {
		t.Fatal(err)
	}
	if err := s.Put("", []byte("x")); !errors.Is(err, ErrInvalid) {
		t.Fatalf("empty id: got %v, want ErrInvalid", err)
	}
	if err := s.Delete("b"); err != nil {
		t.Fatal(err)
	}
	if err := s.Delete("never"); err != nil {
		t.Fatalf("deleting a missing record must be idempotent: %v", err)
	}
	if err := c.Close(); err != nil {
		t.Fatal(err)
	}

	c2, err := Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer c2.Close()
	got, err := c2.Sandboxes().Get("a")
	if err != nil || !bytes.Equal(got, []byte(`{"x":1}`)) {
		t.Fatalf("Get(a) = %q, %v", got, err)
	}
	if _, err := c2.Sandboxes().Get("b"); !errors.Is(err, ErrNotFound) {
		t.Fatalf("Get(b) after delete: %v, want ErrNotFound", err)
	}
	all, err := c2.Sandboxes().All()
	if err != nil || len(all) != 1 {
		t.Fatalf("All = %v, %v", all, err)
	}
}

func TestOpenLockedFails(t *testing.T) {
	_, path := openTemp(t)
	// bbolt's flock is per open file description, so a second Open in the same process
	// contends exactly like a second process would.
	if c, err := Open(path); err == nil {
		c.Close()
		t.Fatal("second Open of a locked catalog succeeded")
	}
}

func TestSecretStable(t *testing.T) {
	c, path := openTemp(t)
	s1, err := c.Secret("seed", 32)
	if err != nil || len(s1) != 32 {
		t.Fatalf("Secret = %x, %v", s1, err)
	}
	s2, _ := c.Secret("seed", 32)
	if !bytes.Equal(s1, s2) {
		t.Fatal("secret changed between calls")
	}
	other, _ := c.Secret("other", 32)
	if bytes.Equal(s1, other) {
		t.Fatal("different secrets are equal")
	}
	if _, err := c.Secret("", 32); !errors.Is(err, ErrInvalid) {
		t.Fatalf("empty name: %v", err)
	}
	c.Close()
	c2, err := Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer c2.Close()
	s3, _ := c2.Secret("seed", 32)
	if !bytes.Equal(s1, s3) {
		t.Fatal("secret not persisted across reopen")
	}
}

func TestTemplates(t *testing.T) {
	c, _ := openTemp(t)
	ts := c.Templates()
	base := Template{ID: "base", Kind: KindTemplate, Aliases: []string{"default", "b"}, RootFSDir: "/x",
		Resources: sandbox.Resources{CPUCount: 2, MemoryMB: 512}}
	if err := ts.Put(base); err != nil {
		t.Fatal(err)
	}
	steps := []struct {
		name string
		put  Template
		want error
	}{
		{"bad id", Template{ID: "a/b", Kind: KindTemplate}, ErrInvalid},
		{"empty id", Template{Kind: KindTemplate}, ErrInvalid},
		{"bad kind", Template{ID: "k", Kind: "vm"}, ErrInvalid},
		{"bad alias", Template{ID: "k", Kind: KindTemplate, Aliases: []string{"x y"}}, ErrInvalid},
		{"negative resources", Template{ID: "k", Kind: KindTemplate, Resources: sandbox.Resources{MemoryMB: -1}}, ErrInvalid},
		{"alias owned by other", Template{ID: "t2", Kind: KindTemplate, Aliases: []string{"default"}}, ErrAliasTaken},
		{"alias equals other id", Template{ID: "t2", Kind: KindTemplate, Aliases: []string{"base"}}, ErrAliasTaken},
		{"id equals other alias", Template{ID: "b", Kind: KindTemplate}, ErrAliasTaken},
		{"snapshot ok", Template{ID: "snap1", Kind: KindSnapshot, SourceSandboxID: "sb"}, nil},
	}
	for _, st := range steps {
		t.Run(st.name, func(t *testing.T) {
			err := ts.Put(st.put)
			if !errors.Is(err, st.want) || (st.want == nil) != (err == nil) {
				t.Fatalf("Put: %v, want %v", err, st.want)
			}
		})
	}
	for _, name := range []string{"base", "default", "b"} {
		got, err := ts.Resolve(name)
		if err != nil || got.ID != "base" || got.Resources.MemoryMB != 512 || got.CreatedAt.IsZero() {
			t.Fatalf("Resolve(%q) = %+v, %v", name, got, err)
		}
	}
	if _, err := ts.Resolve("nope"); !errors.Is(err, ErrNotFound) {
		t.Fatalf("Resolve(nope): %v", err)
	}
	if _, err := ts.Get("default"); !errors.Is(err, ErrNotFound) {
		t.Fatalf("Get takes ids only, got %v", err)
	}

	first, _ := ts.Get("base")
	// Re-put drops alias "b" and adds "c"; "b" becomes free for another template.
	base.Aliases = []string{"default", "c"}
	if err := ts.Put(base); err != nil {
		t.Fatal(err)
	}
	if again, _ := ts.Get("base"); !again.CreatedAt.Equal(first.CreatedAt) {
		t.Fatalf("re-put changed createdAt %v -> %v", first.CreatedAt, again.CreatedAt)
	}
	if _, err := ts.Resolve("b"); !errors.Is(err, ErrNotFound) {
		t.Fatalf("released alias still resolves: %v", err)
	}
	if err := ts.Put(Template{ID: "t3", Kind: KindTemplate, Aliases: []string{"b"}}); err != nil {
		t.Fatalf("released alias not reusable: %v", err)
	}

	list, _ := ts.List(KindSnapshot)
	if len(list) != 1 || list[0].ID != "snap1" {
		t.Fatalf("List(snapshot) = %+v", list)
	}
	all, _ := ts.List("")
	if len(all) != 3 {
		t.Fatalf("List(all) has %d entries", len(all))
	}

	del, err := ts.Delete("c")
	if err != nil || del.ID != "base" {
		t.Fatalf("Delete by alias = %+v, %v", del, err)
	}
	for _, name := range []string{"base", "default", "c"} {
		if _, err := ts.Resolve(name); !errors.Is(err, ErrNotFound) {
			t.Fatalf("%q resolves after delete: %v", name, err)
		}
	}
	if _, err := ts.Delete("base"); !errors.Is(err, ErrNotFound) {
		t.Fatalf("second delete: %v", err)
	}
}

func TestAPIKeys(t *testing.T) {
	c, _ := openTemp(t)
	ks := c.APIKeys()
	key, rec, err := ks.Create("admin")
	if err != nil {
		t.Fatal(err)
	}
	if !regexp.MustCompile(`^e2b_[0-9a-f]{40}$`).MatchString(key) {
		t.Fatalf("key %q does not match the E2B format", key)
	}
	if rec.Hash != HashAPIKey(key) || rec.Hash == key {
		t.Fatal("stored hash is not the SHA-256 of the key")
	}
	if got, err := ks.Lookup(HashAPIKey(key)); err != nil || got.ID != rec.ID {
		t.Fatalf("Lookup = %+v, %v", got, err)
	}
	if _, err := ks.Lookup(HashAPIKey("e2b_wrong")); !errors.Is(err, ErrNotFound) {
		t.Fatalf("Lookup(wrong): %v", err)
	}

	now := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	got, err := ks.Authenticate(key, now)
	if err != nil || !got.LastUsed.Equal(now) {
		t.Fatalf("Authenticate = %+v, %v", got, err)
	}
	got, _ = ks.Authenticate(key, now.Add(10*time.Second))
	if !got.LastUsed.Equal(now) {
		t.Fatal("last-used rewritten within the granularity window")
	}
	got, _ = ks.Authenticate(key, now.Add(2*time.Minute))
	if !got.LastUsed.Equal(now.Add(2 * time.Minute)) {
		t.Fatal("last-used not updated after the window")
	}

	if _, err := ks.Add("dup", key); !errors.Is(err, ErrExists) {
		t.Fatalf("Add duplicate: %v", err)
	}
	if _, err := ks.Add("short", "abc"); !errors.Is(err, ErrInvalid) {
		t.Fatalf("Add short: %v", err)
	}
	explicit := "e2b_" + "0123456789abcdef0123456789abcdef01234567"
	if _, err := ks.Add("ci", explicit); err != nil {
		t.Fatal(err)
	}
	if _, err := ks.Add("ci", "e2b_1111111111111111111111111111111111111111"); err != nil {
		t.Fatal(err)
	}
	list, _ := ks.List()
	if len(list) != 3 {
		t.Fatalf("List has %d keys", len(list))
	}
	if _, err := ks.Revoke("ci"); !errors.Is(err, ErrInvalid) {
		t.Fatalf("ambiguous revoke by name: %v", err)
	}
	if _, err := ks.Revoke("admin"); err != nil {
		t.Fatal(err)
	}
	if _, err := ks.Authenticate(key, now); !errors.Is(err, ErrNotFound) {
		t.Fatalf("revoked key authenticates: %v", err)
	}
	if _, err := ks.Revoke(rec.ID); !errors.Is(err, ErrNotFound) {
		t.Fatalf("second revoke: %v", err)
	}
}

// TestOpenLocked: a second opener of a catalog in use gets ErrLocked (after bbolt's
// lock timeout), which `aenv serve` branches on.
func TestOpenLocked(t *testing.T) {
	path := filepath.Join(t.TempDir(), "aenv.db")
	c, err := Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if c2, err := Open(path); !errors.Is(err, ErrLocked) {
		if c2 != nil {
			c2.Close()
		}
		t.Fatalf("second Open: %v, want ErrLocked", err)
	}
}
