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

func benchRepo(b *testing.B) *Repo {
	r, err := Open(b.TempDir(), Options{})
	if err != nil {
		b.Fatal(err)
	}
	return r
}

func BenchmarkPut64MiB(b *testing.B)   { repositorytest.BenchPut(b, benchRepo(b), 64<<20) }
func BenchmarkGet64MiB(b *testing.B)   { repositorytest.BenchGet(b, benchRepo(b), 64<<20) }
func BenchmarkReadAt1MiB(b *testing.B) { repositorytest.BenchReadAt(b, benchRepo(b), 64<<20) }
