// Package apikey bootstraps and checks the node's API keys: the admin key made on first
// start (or given by AENV_API_KEY), and verification of X-API-Key values against the
// hashes kept in the catalog. Keys are "e2b_" + 40 lowercase hex digits, the format the
// E2B Python SDK checks before sending anything.
package apikey

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"time"

	"github.com/aenv-dev/aenv/internal/catalog"
)

// AdminKeyFile is the name of the file in the data directory that holds the generated
// admin key (mode 0600).
const AdminKeyFile = "admin.key"

// AdminKeyName is the catalog name of the bootstrap key.
const AdminKeyName = "admin"

// e2bFormat is what the Python SDK accepts (E2B_VALIDATE_API_KEY=false disables its check).
var e2bFormat = regexp.MustCompile(`^e2b_[0-9a-f]+$`)

// Store is the part of the catalog's API key store used here (*catalog.APIKeys).
type Store interface {
	Add(name, key string) (catalog.APIKey, error)
	Create(name string) (string, catalog.APIKey, error)
	List() ([]catalog.APIKey, error)
	Authenticate(key string, now time.Time) (catalog.APIKey, error)
}

// Generate returns a new random key (e2b_ + 40 lowercase hex).
func Generate() (string, error) { return catalog.GenerateAPIKey() }

// Hash is the digest stored for a key: lowercase hex SHA-256.
func Hash(key string) string { return catalog.HashAPIKey(key) }

// E2BCompatible reports whether the Python SDK accepts key without
// E2B_VALIDATE_API_KEY=false.
func E2BCompatible(key string) bool { return e2bFormat.MatchString(key) }

// Bootstrapped says how the node got its admin key.
type Bootstrapped struct {
	// Path is the admin key file, when the key lives in one.
	Path string
	// Created is true when this call generated the key.
	Created bool
	// Explicit is true when the key came from AENV_API_KEY (or the config).
	Explicit bool
}

// Bootstrap makes sure the node can be used: with an explicit key it stores that key's hash;
// otherwise, when the catalog holds no keys, it registers the key in <dataDir>/admin.key if
// that file exists (a wiped catalog keeps its operator's key) or generates one and writes it
// there with mode 0600. Existing keys are left alone.
func Bootstrap(_ context.Context, s Store, dataDir, explicit string) (Bootstrapped, error) {
	explicit = strings.TrimSpace(explicit)
	if explicit != "" {
		if _, err := s.Add(AdminKeyName+" (AENV_API_KEY)", explicit); err != nil && !errors.Is(err, catalog.ErrExists) {
			return Bootstrapped{}, fmt.Errorf("store AENV_API_KEY: %w", err)
		}
		return Bootstrapped{Explicit: true}, nil
	}
	path := filepath.Join(dataDir, AdminKeyFile)
	keys, err := s.List()
	if err != nil {
		return Bootstrapped{}, fmt.Errorf("list API keys: %w", err)
	}
	if len(keys) > 0 {
		if _, err := os.Stat(path); err == nil {
			return Bootstrapped{Path: path}, nil
		}
		return Bootstrapped{}, nil
	}
	if raw, err := os.ReadFile(path); err == nil {
		key := strings.TrimSpace(string(raw))
		if _, err := s.Add(AdminKeyName, key); err != nil && !errors.Is(err, catalog.ErrExists) {
			return Bootstrapped{}, fmt.Errorf("register the key in %s: %w", path, err)
		}
		return Bootstrapped{Path: path}, nil
	} else if !errors.Is(err, os.ErrNotExist) {
		return Bootstrapped{}, fmt.Errorf("read %s: %w", path, err)
	}
	key, err := Generate()
	if err != nil {
		return Bootstrapped{}, err
	}
	// Write the file before storing the hash: a key that is stored but written nowhere
	// would lock the operator out.
	if err := WriteKeyFile(path, key); err != nil {
		return Bootstrapped{}, err
	}
	if _, err := s.Add(AdminKeyName, key); err != nil {
		return Bootstrapped{}, fmt.Errorf("store the admin key: %w", err)
	}
	return Bootstrapped{Path: path, Created: true}, nil
}

// WriteKeyFile writes key to path with mode 0600 (directory 0700), atomically.
func WriteKeyFile(path, key string) error {
	if err := os.MkdirAll(filepath.Dir(path), 0o700); err != nil {
		return fmt.Errorf("create %s: %w", filepath.Dir(path), err)
	}
	tmp, err := os.CreateTemp(filepath.Dir(path), ".admin-key-*")
	if err != nil {
		return fmt.Errorf("write %s: %w", path, err)
	}
	defer os.Remove(tmp.Name())
	if err := tmp.Chmod(0o600); err != nil {
		tmp.Close()
		return fmt.Errorf("write %s: %w", path, err)
	}
	if _, err := tmp.WriteString(key + "\n"); err != nil {
		tmp.Close()
		return fmt.Errorf("write %s: %w", path, err)
	}
	if err := tmp.Sync(); err != nil {
		tmp.Close()
		return fmt.Errorf("write %s: %w", path, err)
	}
	if err := tmp.Close(); err != nil {
		return fmt.Errorf("write %s: %w", path, err)
	}
	if err := os.Rename(tmp.Name(), path); err != nil {
		return fmt.Errorf("write %s: %w", path, err)
	}
	return nil
}

// Verifier checks X-API-Key values against the store; it implements the server's
// Authenticator.
type Verifier struct {
	store Store
	now   func() time.Time
}

// NewVerifier returns a Verifier over s.
func NewVerifier(s Store) *Verifier { return &Verifier{store: s, now: time.Now} }

// Authenticate reports whether key is a stored (not revoked) key. Unknown keys are
// (false, nil); err is for store failures only.
func (v *Verifier) Authenticate(_ context.Context, key string) (bool, error) {
	if key == "" {
		return false, nil
	}
	_, err := v.store.Authenticate(key, v.now())
	if errors.Is(err, catalog.ErrNotFound) {
		return false, nil
	}
	if err != nil {
		return false, err
	}
	return true, nil
}
