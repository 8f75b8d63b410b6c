package s3

import (
	"context"
	"testing"

	"github.com/aenv-dev/aenv/internal/repository"
	"github.com/aenv-dev/aenv/internal/repository/repositorytest"
	"github.com/aenv-dev/aenv/internal/repository/s3/s3test"
)

func TestConformance(t *testing.T) {
	srv := s3test.Start(t)
	repositorytest.Run(t, func(t *testing.T) repository.Repository {
		r, err := Open(context.Background(), Config{
			Endpoint: srv.Endpoint, Bucket: srv.Bucket(t), Prefix: "aenv/test",
			Addressing: AddressPath, AccessKey: s3test.AccessKey, SecretKey: s3test.SecretKey,
		})
		if err != nil {
			t.Fatal(err)
		}
		return r
	})
}

func benchRepo(b *testing.B) *Repo {
	srv := s3test.Start(b)
	r, err := Open(context.Background(), Config{
		Endpoint: srv.Endpoint, Bucket: srv.Bucket(b), Addressing: AddressPath,
		AccessKey: s3test.AccessKey, SecretKey: s3test.SecretKey,
	})
	if err != nil {
		b.Fatal(err)
	}
	return r
}

func BenchmarkPut64MiB(b *testing.B)   { repositorytest.BenchPut(b, benchRepo(b), 64<<20) }
func BenchmarkGet64MiB(b *testing.B)   { repositorytest.BenchGet(b, benchRepo(b), 64<<20) }
func BenchmarkReadAt1MiB(b *testing.B) { repositorytest.BenchReadAt(b, benchRepo(b), 64<<20) }
