package secret

import (
	"bytes"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func TestCreateGetListDeleteAcrossReopen(t *testing.T) {
	dir := t.TempDir()
	s, err := Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	const value = "s3cr3t-VALUE-that-must-not-leak"
	info, err := s.Create("alice", "OpenAI-Key", value, map[string]string{"team": "ml"})
	if err != nil {
		t.Fatal(err)
	}
	if info.Name != "openai-key" || info.Version != 1 || !strings.HasPrefix(info.ID, "sec_") || info.Metadata["team"] != "ml" {
		t.Fatalf("info = %+v", info)
	}
	if _, err := s.Create("alice", "openai-key", "x", nil); !errors.Is(err, ErrExists) {
		t.Fatalf("duplicate name: %v, want ErrExists", err)
	}
	// Another owner neither sees the secret nor clashes with its name.
	if _, err := s.Get("bob", info.ID); !errors.Is(err, ErrNotFound) {
		t.Fatalf("bob get: %v", err)
	}
	if _, err := s.Create("bob", "openai-key", "bobs", nil); err != nil {
		t.Fatal(err)
	}

	// The value is encrypted at rest: neither file holds it, and the key is 0600.
	for _, f := range []string{"secrets.json", "node.key"} {
		raw, err := os.ReadFile(filepath.Join(dir, f))
		if err != nil {
			t.Fatal(err)
		}
		if bytes.Contains(raw, []byte(value)) {
			t.Fatalf("%s holds the plaintext value", f)
		}
	}
	fi, err := os.Stat(filepath.Join(dir, "node.key"))
	if err != nil || fi.Mode().Perm() != 0o600 {
		t.Fatalf("node.key: %v %v", fi.Mode(), err)
	}

	s2, err := Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	if v, err := s2.Value("alice", "openai-key"); err != nil || v != value {
		t.Fatalf("value after reopen = %q, %v", v, err)
	}
	up, err := s2.Update("alice", info.ID, "v2", nil)
	if err != nil || up.Version != 2 || up.Metadata["team"] != "ml" {
		t.Fatalf("update = %+v, %v", up, err)
	}
	if got, err := s2.Expand("alice", "Bearer ${e2b.secrets.openai-key}!"); err != nil || got != "Bearer v2!" {
		t.Fatalf("expand = %q, %v", got, err)
	}
	if _, err := s2.Expand("alice", "${e2b.secrets.nope}"); !errors.Is(err, ErrNotFound) {
		t.Fatalf("expand unknown: %v", err)
	}
	list, next, err := s2.List("alice", 0, "")
	if err != nil || len(list) != 1 || next != "" {
		t.Fatalf("list = %+v %q %v", list, next, err)
	}
	if err := s2.Delete("alice", "openai-key"); err != nil {
		t.Fatal(err)
	}
	if err := s2.Delete("alice", "openai-key"); !errors.Is(err, ErrNotFound) {
		t.Fatalf("second delete: %v", err)
	}
	if v, err := s2.Value("bob", "openai-key"); err != nil || v != "bobs" {
		t.Fatalf("bob's secret after alice's delete: %q %v", v, err)
	}
}

func TestBadInputChangesNothing(t *testing.T) {
	s, err := Open(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	bigMeta := map[string]string{}
	for i := range MaxMetadataEntries + 1 {
		bigMeta[strings.Repeat("k", i+1)] = "v"
	}
	cases := []struct {
		name, value string
		meta        map[string]string
	}{
		{"", "v", nil},
		{"sec_abc", "v", nil},
		{"has space", "v", nil},
		{"brace{", "v", nil},
		{strings.Repeat("a", 129), "v", nil},
		{"ok", "", nil},
		{"ok", strings.Repeat("x", MaxValueBytes+1), nil},
		{"ok", "nul\x00", nil},
		{"ok", "v", bigMeta},
		{"ok", "v", map[string]string{"k": strings.Repeat("v", MaxMetadataValBytes+1)}},
	}
	for _, c := range cases {
		if _, err := s.Create("o", c.name, c.value, c.meta); !errors.Is(err, ErrInvalid) {
			t.Errorf("Create(%.20q, %d bytes): %v, want ErrInvalid", c.name, len(c.value), err)
		}
	}
	if l, _, _ := s.List("o", 0, ""); len(l) != 0 {
		t.Fatalf("bad input stored %d secrets", len(l))
	}
	if _, _, err := s.List("o", MaxListLimit+1, ""); !errors.Is(err, ErrInvalid) {
		t.Fatalf("list limit: %v", err)
	}
}

func TestListPages(t *testing.T) {
	s, err := Open(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	for _, n := range []string{"c", "a", "b", "d", "e"} {
		if _, err := s.Create("o", n, "v", nil); err != nil {
			t.Fatal(err)
		}
	}
	var got []string
	next := ""
	for {
		page, tok, err := s.List("o", 2, next)
		if err != nil {
			t.Fatal(err)
		}
		for _, i := range page {
			got = append(got, i.Name)
		}
		if tok == "" {
			break
		}
		next = tok
	}
	if strings.Join(got, ",") != "a,b,c,d,e" {
		t.Fatalf("pages = %v", got)
	}
}

func TestTamperedCiphertextIsRefused(t *testing.T) {
	dir := t.TempDir()
	s, err := Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := s.Create("o", "k", "value", nil); err != nil {
		t.Fatal(err)
	}
	// Moving a sealed value to another owner must not decrypt: the owner is authenticated.
	for _, r := range s.recs {
		r.Owner = "mallory"
	}
	if _, err := s.Value("mallory", "k"); err == nil {
		t.Fatalf("re-owned ciphertext: %v", err)
	}
}
