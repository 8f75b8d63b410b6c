package snapshot

import (
	"context"
	"slices"
	"testing"

	"github.com/aenv-dev/aenv/internal/repository"
	"github.com/aenv-dev/aenv/internal/repository/s3"
	"github.com/aenv-dev/aenv/internal/repository/s3/s3test"
)

// The S3 server dies in the middle of an upload. Short outages are ridden
// out by retries; a longer one fails the publication but keeps its journal
// and pending record (no other node uses it), and Resume completes it once
// the server is back.
func TestS3OutageMidPublish(t *testing.T) {
	ctx := context.Background()
	srv := s3test.Start(t)
	remote, err := s3.Open(ctx, s3.Config{Endpoint: srv.Endpoint, Bucket: srv.Bucket(t), Addressing: s3.AddressPath,
		AccessKey: s3test.AccessKey, SecretKey: s3test.SecretKey})
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name     string
		attempts int
		outlive  bool // the outage outlasts the retries
	}{
		{"ridden out by retries", 40, false},
		{"resumed after failure", 2, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			g := newGated(remote)
			n := newNode(t, "node-"+map[bool]string{false: "a", true: "b"}[tc.outlive], g, Options{MaxAttempts: tc.attempts})
			nb := newNode(t, "node-c", remote, Options{})
			files, _ := stackLayers(t, t.TempDir(), 2, 11)
			id := "snap-outage-" + map[bool]string{false: "a", true: "b"}[tc.outlive]
			h, err := n.pub.Publish(ctx, testManifest(t, id, files))
			if err != nil {
				t.Fatal(err)
			}
			<-g.puts
			srv.Kill()
			g.open()
			if tc.outlive {
				if err := h.Wait(ctx); err == nil || h.Status().State != StateFailed {
					t.Fatalf("publication survived an outage longer than its retries: %v", err)
				}
				if !n.pub.journaled(id) {
					t.Fatal("journal dropped after a transient failure")
				}
				srv.Restart(t)
				if res, err := nb.pub.Sync(ctx); err != nil || slices.Contains(res.Added, id) {
					t.Fatalf("another node synced a failed publication: %+v %v", res, err)
				}
				hs, err := n.pub.Resume(ctx)
				if err != nil || len(hs) != 1 {
					t.Fatalf("Resume = %d handles, %v", len(hs), err)
				}
				h = hs[0]
			} else {
				<-g.fails // an upload has failed against the dead server
				srv.Restart(t)
			}
			if err := h.Wait(ctx); err != nil {
				t.Fatal(err)
			}
			rec, err := remote.GetRecord(ctx, repository.KindSnapshot, id)
			if err != nil || rec.State != repository.StateComplete {
				t.Fatalf("record %+v %v", rec, err)
			}
			if res, err := nb.pub.Sync(ctx); err != nil || !slices.Contains(res.Added, id) {
				t.Fatalf("sync after completion %+v %v", res, err)
			}
		})
	}
}
