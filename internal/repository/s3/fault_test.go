package s3

import (
	"bytes"
	"context"
	"errors"
	"io"
	"testing"
	"time"

	"github.com/aenv-dev/aenv/internal/repository"
	"github.com/aenv-dev/aenv/internal/repository/repositorytest"
	"github.com/aenv-dev/aenv/internal/repository/s3/s3test"
)

// pausingReader serves data, stopping at pauseAt until release is closed.
type pausingReader struct {
	data    []byte
	off     int
	pauseAt int
	paused  chan struct{}
	release chan struct{}
}

func (p *pausingReader) Read(b []byte) (int, error) {
	if p.off == p.pauseAt {
		close(p.paused)
		<-p.release
		p.pauseAt = -1
	}
	end := len(p.data)
	if p.pauseAt > p.off {
		end = p.pauseAt
	}
	n := copy(b, p.data[p.off:end])
	p.off += n
	if n == 0 {
		return 0, io.EOF
	}
	return n, nil
}

// The server dying in the middle of a multipart upload fails the put; after
// it comes back nothing partial is visible and the publication can be
// redone.
func TestServerKilledMidPublish(t *testing.T) {
	if testing.Short() {
		t.Skip("uploads tens of MiB")
	}
	srv := s3test.Start(t)
	bucket := srv.Bucket(t)
	cfg := Config{Endpoint: srv.Endpoint, Bucket: bucket, Addressing: AddressPath, AccessKey: s3test.AccessKey, SecretKey: s3test.SecretKey}
	ctx := context.Background()
	r, err := Open(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	data, d := repositorytest.Blob(9, 40<<20)
	pr := &pausingReader{data: data, pauseAt: 20 << 20, paused: make(chan struct{}), release: make(chan struct{})}
	done := make(chan error, 1)
	putCtx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	go func() {
		_, err := r.PutBlob(putCtx, d, int64(len(data)), pr)
		done <- err
	}()
	select {
	case <-pr.paused:
	case err := <-done:
		t.Fatalf("put finished before the pause: %v", err)
	}
	srv.Kill()
	// The client retries a dead server for a while; a publisher gives up.
	// (minio-go then still tries, detached from ctx, for up to a minute to
	// abort the multipart upload, so the put fails some seconds later.)
	time.AfterFunc(3*time.Second, cancel)
	close(pr.release)
	if err := <-done; err == nil {
		t.Fatal("put succeeded with the server dead")
	}
	shortCtx, cancelShort := context.WithTimeout(ctx, 3*time.Second)
	defer cancelShort()
	if _, err := r.PutRecord(shortCtx, repositorytest.Record(repository.KindSnapshot, "during-outage", d)); err == nil {
		t.Fatal("record published with the server dead")
	}

	srv.Restart(t)
	if _, err := r.StatBlob(ctx, d); !errors.Is(err, repository.ErrNotFound) {
		t.Fatalf("partial blob visible after the outage: %v", err)
	}
	if _, err := r.GetRecord(ctx, repository.KindSnapshot, "during-outage"); !errors.Is(err, repository.ErrNotFound) {
		t.Fatalf("record from the outage: %v", err)
	}
	if _, err := r.PutBlob(ctx, d, int64(len(data)), bytes.NewReader(data)); err != nil {
		t.Fatalf("retrying the publication: %v", err)
	}
	if got, err := repository.ReadAll(ctx, r, d); err != nil || !bytes.Equal(got, data) {
		t.Fatalf("blob after retry: %v", err)
	}
}
