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
