package s3

import (
	"bytes"
	"context"
	"slices"
	"testing"
	"time"

	"github.com/minio/minio-go/v7"

	"github.com/aenv-dev/aenv/internal/repository"
	"github.com/aenv-dev/aenv/internal/repository/repositorytest"
	"github.com/aenv-dev/aenv/internal/repository/s3/s3test"
)

// A publisher killed mid-upload leaves a multipart upload: Open and GC abort
// the ones under the prefix older than StaleUploadAge, and leave younger
// ones and other prefixes' alone.
func TestAbortStaleUploads(t *testing.T) {
	srv := s3test.Start(t)
	bucket := srv.Bucket(t)
	ctx := context.Background()
	cfg := Config{Endpoint: srv.Endpoint, Bucket: bucket, Prefix: "aenv/t", Addressing: AddressPath,
		AccessKey: s3test.AccessKey, SecretKey: s3test.SecretKey}
	r, err := Open(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	core := minio.Core{Client: r.c}
	start := func(key string) {
		t.Helper()
		id, err := core.NewMultipartUpload(ctx, bucket, key, minio.PutObjectOptions{})
		if err != nil {
			t.Fatal(err)
		}
		if _, err := core.PutObjectPart(ctx, bucket, key, id, 1, bytes.NewReader(make([]byte, 1<<20)), 1<<20, minio.PutObjectPartOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	uploads := func() []string {
		t.Helper()
		var keys []string
		for u := range r.c.ListIncompleteUploads(ctx, bucket, "", true) {
			if u.Err != nil {
				t.Fatal(u.Err)
			}
			keys = append(keys, u.Key)
		}
		slices.Sort(keys)
		return keys
	}
	_, d1 := repositorytest.Blob(1, 10)
	_, d2 := repositorytest.Blob(2, 10)
	ours1, ours2 := r.blobKey(d1), r.blobKey(d2)
	other := "other/blobs/sha256/" + d1.Hex()
	start(ours1)
	start(other)
	if _, err := Open(ctx, cfg); err != nil {
		t.Fatal(err)
	}
	if got := uploads(); !slices.Equal(got, []string{ours1, other}) {
		t.Fatalf("an upload younger than StaleUploadAge was touched: %v", got)
	}

	time.Sleep(20 * time.Millisecond)
	short := cfg
	short.StaleUploadAge = 10 * time.Millisecond
	rs, err := Open(ctx, short)
	if err != nil {
		t.Fatal(err)
	}
	if got := uploads(); !slices.Equal(got, []string{other}) {
		t.Fatalf("after Open, uploads %v; want only the other prefix's", got)
	}

	start(ours2)
	time.Sleep(20 * time.Millisecond)
	res, err := repository.GC(ctx, rs, repository.GCOptions{Grace: -1})
	if err != nil {
		t.Fatal(err)
	}
	if res.AbortedUploads != 1 {
		t.Fatalf("GC aborted %d uploads, want 1", res.AbortedUploads)
	}
	if got := uploads(); !slices.Equal(got, []string{other}) {
		t.Fatalf("after GC, uploads %v; want only the other prefix's", got)
	}
}
