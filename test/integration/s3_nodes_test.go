package integration

import (
	"context"
	"testing"

	"github.com/aenv-dev/aenv/internal/repository/s3"
	"github.com/aenv-dev/aenv/internal/repository/s3/s3test"
)

// TestSharedS3Repository is TestSharedPosixRepository with the two nodes sharing one
// bucket of a real S3 server (versitygw, started by the test) instead of a directory:
// what node A publishes there node B syncs, fetches and runs.
func TestSharedS3Repository(t *testing.T) {
	needNode(t)
	srv := s3test.Start(t)
	bucket := srv.Bucket(t)
	const prefix = "aenv/it"
	repo, err := s3.Open(context.Background(), s3.Config{Endpoint: srv.Endpoint, Bucket: bucket, Prefix: prefix,
		Addressing: s3.AddressPath, AccessKey: s3test.AccessKey, SecretKey: s3test.SecretKey})
	if err != nil {
		t.Fatal(err)
	}
	nets := []nodeNet{
		{bridge: "aenvsa0", subnet: "10.96.6.0/25", prefix: "aenvsa", cgroup: "aenv-it-sa"},
		{bridge: "aenvsb0", subnet: "10.96.6.128/25", prefix: "aenvsb", cgroup: "aenv-it-sb"},
	}
	sharedRepositoryFlow(t, nets, repo,
		"AENV_SNAPSHOT_REPOSITORY_BACKEND=s3",
		"AENV_REPOSITORY_S3_ENDPOINT="+srv.Endpoint,
		"AENV_REPOSITORY_S3_BUCKET="+bucket,
		"AENV_REPOSITORY_S3_PREFIX="+prefix,
		"AENV_REPOSITORY_S3_ADDRESSING=path",
		"AENV_REPOSITORY_S3_ACCESS_KEY="+s3test.AccessKey,
		"AENV_REPOSITORY_S3_SECRET_KEY="+s3test.SecretKey)
}
