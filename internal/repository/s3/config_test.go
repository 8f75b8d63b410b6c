package s3

import (
	"bytes"
	"context"
	"errors"
	"net"
	"net/http"
	"strings"
	"sync"
	"testing"

	"github.com/minio/minio-go/v7"

	"github.com/aenv-dev/aenv/internal/repository"
	"github.com/aenv-dev/aenv/internal/repository/repositorytest"
	"github.com/aenv-dev/aenv/internal/repository/s3/s3test"
)

func TestConfigRejected(t *testing.T) {
	for _, tc := range []struct {
		name string
		cfg  Config
	}{
		{"no endpoint", Config{Bucket: "b"}},
		{"no bucket", Config{Endpoint: "127.0.0.1:1"}},
		{"bad scheme", Config{Endpoint: "ftp://127.0.0.1:1", Bucket: "b"}},
		{"endpoint with path", Config{Endpoint: "http://127.0.0.1:1/x", Bucket: "b"}},
		{"dotdot prefix", Config{Endpoint: "127.0.0.1:1", Bucket: "b", Prefix: "a/../b"}},
		{"double slash prefix", Config{Endpoint: "127.0.0.1:1", Bucket: "b", Prefix: "a//b"}},
		{"bad addressing", Config{Endpoint: "127.0.0.1:1", Bucket: "b", Addressing: "dns"}},
		{"tiny parts", Config{Endpoint: "127.0.0.1:1", Bucket: "b", PartSize: 1 << 20}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if _, err := Open(context.Background(), tc.cfg); !errors.Is(err, repository.ErrInvalid) {
				t.Fatalf("Open = %v, want ErrInvalid", err)
			}
		})
	}
}

func TestServer(t *testing.T) {
	srv := s3test.Start(t)
	ctx := context.Background()
	bucket := srv.Bucket(t)
	static := Config{Endpoint: srv.Endpoint, Bucket: bucket, Addressing: AddressPath, AccessKey: s3test.AccessKey, SecretKey: s3test.SecretKey}

	t.Run("EnvCredentials", func(t *testing.T) {
		t.Setenv("AWS_ACCESS_KEY_ID", s3test.AccessKey)
		t.Setenv("AWS_SECRET_ACCESS_KEY", s3test.SecretKey)
		cfg := static
		cfg.AccessKey, cfg.SecretKey = "", ""
		if _, err := Open(ctx, cfg); err != nil {
			t.Fatalf("env credentials: %v", err)
		}
	})
	t.Run("WrongCredentials", func(t *testing.T) {
		cfg := static
		cfg.SecretKey = "wrong"
		if _, err := Open(ctx, cfg); err == nil || errors.Is(err, repository.ErrNotFound) {
			t.Fatalf("wrong secret: %v", err)
		}
	})
	t.Run("MissingBucket", func(t *testing.T) {
		cfg := static
		cfg.Bucket = "no-such-bucket"
		if _, err := Open(ctx, cfg); !errors.Is(err, repository.ErrNotFound) {
			t.Fatalf("missing bucket: %v, want ErrNotFound", err)
		}
	})
	t.Run("VirtualHostAddressing", func(t *testing.T) {
		// bucket.localhost:port is dialled at the server's loopback address.
		_, port, _ := net.SplitHostPort(srv.Addr)
		dialer := &net.Dialer{}
		cfg := static
		cfg.Endpoint = "http://localhost:" + port
		cfg.Addressing = AddressVirtual
		var mu sync.Mutex
		var hosts []string
		cfg.Transport = &http.Transport{DialContext: func(ctx context.Context, network, addr string) (net.Conn, error) {
			mu.Lock()
			hosts = append(hosts, addr)
			mu.Unlock()
			return dialer.DialContext(ctx, network, srv.Addr)
		}}
		r, err := Open(ctx, cfg)
		if err != nil {
			t.Fatal(err)
		}
		b, d := repositorytest.Blob(3, 1000)
		if _, err := r.PutBlob(ctx, d, int64(len(b)), bytes.NewReader(b)); err != nil {
			t.Fatal(err)
		}
		if got, err := repository.ReadAll(ctx, r, d); err != nil || !bytes.Equal(got, b) {
			t.Fatalf("read back: %v", err)
		}
		mu.Lock()
		defer mu.Unlock()
		if len(hosts) == 0 || !strings.HasPrefix(hosts[0], bucket+".localhost:") {
			t.Fatalf("dialled %v, want virtual host %s.localhost", hosts, bucket)
		}
	})
	t.Run("ConditionalWritesHonoured", func(t *testing.T) {
		// Record publication relies on these; a server that ignored them
		// would make PutRecord last-writer-wins.
		r, err := Open(ctx, static)
		if err != nil {
			t.Fatal(err)
		}
		put := func(body string, cond func(*minio.PutObjectOptions)) (minio.UploadInfo, error) {
			o := minio.PutObjectOptions{DisableMultipart: true}
			cond(&o)
			return r.c.PutObject(ctx, bucket, "cond", strings.NewReader(body), int64(len(body)), o)
		}
		first, err := put("a", func(o *minio.PutObjectOptions) { o.SetMatchETagExcept("*") })
		if err != nil {
			t.Fatal(err)
		}
		if _, err := put("b", func(o *minio.PutObjectOptions) { o.SetMatchETagExcept("*") }); minio.ToErrorResponse(err).StatusCode != http.StatusPreconditionFailed {
			t.Fatalf("If-None-Match * over an object: %v, want 412", err)
		}
		if _, err := put("c", func(o *minio.PutObjectOptions) { o.SetMatchETag(first.ETag) }); err != nil {
			t.Fatalf("If-Match current etag: %v", err)
		}
		if _, err := put("d", func(o *minio.PutObjectOptions) { o.SetMatchETag(first.ETag) }); minio.ToErrorResponse(err).StatusCode != http.StatusPreconditionFailed {
			t.Fatalf("If-Match stale etag: %v, want 412", err)
		}
	})
	t.Run("PrefixesIsolate", func(t *testing.T) {
		a, b := static, static
		a.Prefix, b.Prefix = "/team-a/", "team-b"
		ra, err := Open(ctx, a)
		if err != nil {
			t.Fatal(err)
		}
		rb, err := Open(ctx, b)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := ra.PutRecord(ctx, repositorytest.Record(repository.KindTemplate, "t")); err != nil {
			t.Fatal(err)
		}
		if _, err := rb.GetRecord(ctx, repository.KindTemplate, "t"); !errors.Is(err, repository.ErrNotFound) {
			t.Fatalf("record leaked across prefixes: %v", err)
		}
		if p, err := rb.ListRecords(ctx, repository.KindTemplate, repository.ListOptions{}); err != nil || len(p.Records) != 0 {
			t.Fatalf("list across prefixes: %+v %v", p, err)
		}
	})
}
