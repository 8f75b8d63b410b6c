package integration

import (
	"context"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/aenv-dev/aenv/internal/bench"
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

// TestS3UnreachableMidPublish: the S3 server dies while a node publishes a snapshot. The
// snapshot is answered and usable on the node all the same, its publication stays pending
// on the node while the server is down, and once the server is back the node completes
// it by itself, every blob in place.
func TestS3UnreachableMidPublish(t *testing.T) {
	needNode(t)
	srv := s3test.Start(t)
	bucket := srv.Bucket(t)
	repo, err := s3.Open(context.Background(), s3.Config{Endpoint: srv.Endpoint, Bucket: bucket,
		Addressing: s3.AddressPath, AccessKey: s3test.AccessKey, SecretKey: s3test.SecretKey})
	if err != nil {
		t.Fatal(err)
	}
	n := newNode(t, "AENV_SANDBOX_SHUTDOWN_ACTION=stop", "AENV_SNAPSHOT_SYNC_INTERVAL=1s",
		"AENV_SNAPSHOT_REPOSITORY_BACKEND=s3", "AENV_REPOSITORY_S3_ENDPOINT="+srv.Endpoint,
		"AENV_REPOSITORY_S3_BUCKET="+bucket, "AENV_REPOSITORY_S3_ADDRESSING=path",
		"AENV_REPOSITORY_S3_ACCESS_KEY="+s3test.AccessKey, "AENV_REPOSITORY_S3_SECRET_KEY="+s3test.SecretKey)
	n.start()
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	c := n.client()
	src := n.create(ctx, c)
	run(ctx, t, c, src, "echo v1 > /home/user/marker && head -c 32000000 /dev/urandom > /home/user/big")

	srv.Kill()
	snapID := takeSnapshot(ctx, t, n, src.ID, "")
	child, err := c.Create(ctx, bench.CreateRequest{TemplateID: snapID, Timeout: 300, Secure: true})
	if err != nil {
		t.Fatalf("create from a snapshot whose publication is stuck: %v", err)
	}
	n.observe()
	if got := run(ctx, t, c, child, "cat /home/user/marker"); got != "v1" {
		t.Fatalf("sandbox from the snapshot reads %q", got)
	}
	time.Sleep(3 * time.Second) // uploads fail and retry meanwhile
	// While the server is down the publication stays pending on the node (its journal),
	// so the node finishes it later. (The record itself cannot be read then, and after the
	// restart the node may complete it at any moment.)
	if _, err := os.Stat(filepath.Join(n.dataDir, "snapshot", "publishing", snapID+".json")); err != nil {
		t.Fatalf("publication of %s not pending on the node while the repository is down: %v", snapID, err)
	}
	srv.Restart(t)
	waitComplete(ctx, t, repo, snapID)

	killAll(ctx, t, c)
	n.stop()
	requireNoLeftovers(t, n, nil)
}
