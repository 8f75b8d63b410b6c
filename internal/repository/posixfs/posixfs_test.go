package posixfs

import (
	"testing"

	"github.com/aenv-dev/aenv/internal/repository"
	"github.com/aenv-dev/aenv/internal/repository/repositorytest"
)

func newRepo(t *testing.T) repository.Repository {
	r, err := Open(t.TempDir(), Options{})
	if err != nil {
		t.Fatal(err)
	}
	return r
}

func TestConformance(t *testing.T) { repositorytest.Run(t, newRepo) }
