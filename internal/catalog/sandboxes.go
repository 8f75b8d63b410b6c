package catalog

import (
	"fmt"

	bolt "go.etcd.io/bbolt"
)

// Sandboxes stores one opaque record (the orchestrator's JSON) per sandbox id. Puts and
// deletes from concurrent callers share transactions (groupCommit).
type Sandboxes struct {
	db     *bolt.DB
	writes *groupCommit
}

// Put creates or replaces the record of id.
func (s *Sandboxes) Put(id string, rec []byte) error {
	if id == "" {
		return fmt.Errorf("%w: empty sandbox id", ErrInvalid)
	}
	return wrap("put sandbox", s.writes.do(func(tx *bolt.Tx) error {
		return tx.Bucket(bucketSandboxes).Put([]byte(id), rec)
	}))
}

// Get returns a copy of the record of id, or ErrNotFound.
func (s *Sandboxes) Get(id string) ([]byte, error) {
	var out []byte
	err := s.db.View(func(tx *bolt.Tx) error {
		v := tx.Bucket(bucketSandboxes).Get([]byte(id))
		if v == nil {
			return fmt.Errorf("sandbox %q: %w", id, ErrNotFound)
		}
		out = append([]byte(nil), v...)
		return nil
	})
	return out, wrap("get sandbox", err)
}

// Delete removes the record of id; deleting a missing record is not an error, so a
// retried kill stays idempotent.
func (s *Sandboxes) Delete(id string) error {
	return wrap("delete sandbox", s.writes.do(func(tx *bolt.Tx) error {
		return tx.Bucket(bucketSandboxes).Delete([]byte(id))
	}))
}

// All returns every record keyed by id.
func (s *Sandboxes) All() (map[string][]byte, error) {
	out := map[string][]byte{}
	err := s.db.View(func(tx *bolt.Tx) error {
		return tx.Bucket(bucketSandboxes).ForEach(func(k, v []byte) error {
			out[string(k)] = append([]byte(nil), v...)
			return nil
		})
	})
	return out, wrap("list sandboxes", err)
}
