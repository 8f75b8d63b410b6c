// Package s3 is a repository in an S3-compatible bucket (AWS S3, MinIO,
// versitygw, Ceph RGW, OSS in S3 mode) through minio-go. Keys, relative to
// the configured prefix:
//
//	blobs/sha256/<hex>        blob bytes
//	blobs-used/sha256/<hex>   empty marker rewritten when a Put deduplicates
//	                          the blob; its LastModified is the blob's LastUsed
//	                          (S3 cannot touch an object without copying it)
//	records/<kind>/<id>       a record (JSON); no suffix, so key order is id
//	                          order and listing pages map to S3 list pages
//
// Semantics. A PUT is atomic in S3: readers see the old object or the new,
// never a part. Blobs stream through a sha256 verifier that fails the read
// delivering the last byte when the content does not match, so the upload
// (single PUT or multipart, above PartSize) is aborted before it completes;
// nothing is stored under a wrong digest. Records are published with
// conditional writes: If-None-Match: * to create, If-Match: <etag> to update
// (AWS S3 since 2024, MinIO, versitygw; the tests check that versitygw
// honours them); a precondition failure is ErrExists / ErrConflict, so
// racing writers get compare-and-swap and no update is lost. Every record
// write is also read back: a later revision there means another writer built
// on ours (ours committed); the same revision with other bytes means ours
// was replaced by a writer that never saw it, which only a server ignoring
// the conditions allows, and is reported as ErrConflict. On such a server a
// lost update still goes unnoticed when the other PUT lands between ours and
// our read-back: use a server with conditional writes for a repository that
// several nodes write. GC's conditional blob delete checks LastUsed and then
// deletes: a publisher that dedups the blob between those two requests can
// lose it, so publishers Stat their blobs after writing the pending record
// and before marking it complete.
package s3

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/url"
	"strings"
	"time"

	"github.com/minio/minio-go/v7"
	"github.com/minio/minio-go/v7/pkg/credentials"

	"github.com/aenv-dev/aenv/internal/repository"
)

// Addressing selects how the bucket is named in requests.
type Addressing string

const (
	AddressAuto    Addressing = ""        // minio-go decides (virtual for AWS and known clouds)
	AddressPath    Addressing = "path"    // http://endpoint/bucket/key
	AddressVirtual Addressing = "virtual" // http://bucket.endpoint/key
)

// Config locates the bucket.
type Config struct {
	// Endpoint is "host:port" (HTTPS) or an http:// or https:// URL.
	Endpoint   string
	Bucket     string
	Prefix     string // key prefix, e.g. "aenv/prod"; may be empty
	Region     string
	Addressing Addressing
	// AccessKey and SecretKey (and SessionToken) are static credentials;
	// when AccessKey is empty the environment is used (AWS_ACCESS_KEY_ID /
	// AWS_SECRET_ACCESS_KEY / AWS_SESSION_TOKEN, then MINIO_ACCESS_KEY /
	// MINIO_SECRET_KEY, then the AWS shared credentials file).
	AccessKey, SecretKey, SessionToken string
	// PartSize is the multipart part size; blobs larger than it are
	// uploaded in parts (default 16 MiB, minimum 5 MiB as S3 requires).
	PartSize uint64
	// UploadParallelism is how many parts of one blob are in flight at once
	// (default 4); each holds a PartSize buffer.
	UploadParallelism uint
	// StaleUploadAge is how old an unfinished multipart upload under the
	// prefix must be for Open and GC to abort it (default 1h): a publisher
	// killed mid-upload leaves parts that hold storage and that nothing
	// else ever removes. An upload that legitimately runs longer than this
	// would be aborted by another node's GC, so keep it above the slowest
	// blob upload.
	StaleUploadAge time.Duration
	// Transport overrides the HTTP transport (tests, custom CAs).
	Transport http.RoundTripper
	Logger    *slog.Logger
}

// Repo is a repository in a bucket.
type Repo struct {
	c        *minio.Client
	bucket   string
	prefix   string
	part     uint64
	parallel uint
	stale    time.Duration
	log      *slog.Logger
}

var _ repository.Repository = (*Repo)(nil)

// Open connects and checks that the bucket exists; it does not create it
// (buckets are provisioned, and their policies are not ours to choose).
func Open(ctx context.Context, cfg Config) (*Repo, error) {
	if cfg.Endpoint == "" || cfg.Bucket == "" {
		return nil, fmt.Errorf("%w: s3 endpoint and bucket are required", repository.ErrInvalid)
	}
	host, secure := cfg.Endpoint, true
	if strings.Contains(cfg.Endpoint, "://") {
		u, err := url.Parse(cfg.Endpoint)
		if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" || (u.Path != "" && u.Path != "/") {
			return nil, fmt.Errorf("%w: s3 endpoint %q: want host:port or http(s)://host:port", repository.ErrInvalid, cfg.Endpoint)
		}
		host, secure = u.Host, u.Scheme == "https"
	}
	prefix := strings.Trim(cfg.Prefix, "/")
	if strings.Contains(prefix, "//") || strings.Contains("/"+prefix+"/", "/../") || strings.Contains("/"+prefix+"/", "/./") {
		return nil, fmt.Errorf("%w: s3 prefix %q", repository.ErrInvalid, cfg.Prefix)
	}
	if prefix != "" {
		prefix += "/"
	}
	lookup := minio.BucketLookupAuto
	switch cfg.Addressing {
	case AddressAuto:
	case AddressPath:
		lookup = minio.BucketLookupPath
	case AddressVirtual:
		lookup = minio.BucketLookupDNS
	default:
		return nil, fmt.Errorf("%w: s3 addressing %q (want path or virtual)", repository.ErrInvalid, cfg.Addressing)
	}
	var creds *credentials.Credentials
	if cfg.AccessKey != "" {
		creds = credentials.NewStaticV4(cfg.AccessKey, cfg.SecretKey, cfg.SessionToken)
	} else {
		// No instance-metadata provider: it would probe a link-local address
		// on every node that merely lacks configuration.
		creds = credentials.NewChainCredentials([]credentials.Provider{
			&credentials.EnvAWS{}, &credentials.EnvMinio{}, &credentials.FileAWSCredentials{},
		})
	}
	part := cfg.PartSize
	if part == 0 {
		part = 16 << 20
	}
	if part < 5<<20 {
		return nil, fmt.Errorf("%w: s3 part size %d below the 5 MiB S3 minimum", repository.ErrInvalid, part)
	}
	c, err := minio.New(host, &minio.Options{
		Creds: creds, Secure: secure, Region: cfg.Region, BucketLookup: lookup, Transport: cfg.Transport,
	})
	if err != nil {
		return nil, fmt.Errorf("s3: %w", err)
	}
	log := cfg.Logger
	if log == nil {
		log = slog.Default()
	}
	ok, err := c.BucketExists(ctx, cfg.Bucket)
	if err != nil {
		return nil, fmt.Errorf("s3: bucket %s at %s: %w", cfg.Bucket, cfg.Endpoint, err)
	}
	if !ok {
		return nil, fmt.Errorf("%w: s3 bucket %s at %s", repository.ErrNotFound, cfg.Bucket, cfg.Endpoint)
	}
	parallel := cfg.UploadParallelism
	if parallel == 0 {
		parallel = 4
	}
	stale := cfg.StaleUploadAge
	if stale <= 0 {
		stale = DefaultStaleUploadAge
	}
	r := &Repo{c: c, bucket: cfg.Bucket, prefix: prefix, part: part, parallel: parallel, stale: stale, log: log}
	if _, err := r.AbortStaleUploads(ctx); err != nil {
		// Storage is wasted, nothing is wrong: GC retries.
		log.Warn("s3: abort stale multipart uploads", "bucket", cfg.Bucket, "prefix", prefix, "err", err)
	}
	return r, nil
}

// DefaultStaleUploadAge is Config.StaleUploadAge's default.
const DefaultStaleUploadAge = time.Hour

var _ repository.UploadReclaimer = (*Repo)(nil)

// AbortStaleUploads aborts the multipart uploads of blobs under the prefix
// started more than StaleUploadAge ago, and returns how many it aborted.
func (r *Repo) AbortStaleUploads(ctx context.Context) (int, error) {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel() // stops the listing goroutine when we return early
	cutoff := time.Now().Add(-r.stale)
	core := minio.Core{Client: r.c}
	n := 0
	var errs []error
	for u := range r.c.ListIncompleteUploads(ctx, r.bucket, r.prefix+"blobs/", true) {
		if u.Err != nil {
			return n, errors.Join(append(errs, fmt.Errorf("s3: list multipart uploads: %w", u.Err))...)
		}
		if u.Initiated.After(cutoff) {
			continue
		}
		err := core.AbortMultipartUpload(ctx, r.bucket, u.Key, u.UploadID)
		if err != nil && minio.ToErrorResponse(err).Code != "NoSuchUpload" {
			errs = append(errs, fmt.Errorf("s3: abort multipart upload of %s: %w", u.Key, err))
			continue
		}
		n++
		r.log.Info("s3: aborted a stale multipart upload", "key", u.Key, "initiated", u.Initiated, "bytes", u.Size)
	}
	return n, errors.Join(errs...)
}

func (r *Repo) blobKey(d repository.Digest) string { return r.prefix + "blobs/sha256/" + d.Hex() }
func (r *Repo) usedKey(d repository.Digest) string { return r.prefix + "blobs-used/sha256/" + d.Hex() }

func isNotFound(err error) bool {
	switch minio.ToErrorResponse(err).Code {
	case "NoSuchKey", "NotFound":
		return true
	}
	return minio.ToErrorResponse(err).StatusCode == http.StatusNotFound
}

// PutBlob implements repository.Repository.
func (r *Repo) PutBlob(ctx context.Context, d repository.Digest, size int64, src io.Reader) (repository.BlobInfo, error) {
	if err := d.Validate(); err != nil {
		return repository.BlobInfo{}, err
	}
	if src == nil {
		return repository.BlobInfo{}, fmt.Errorf("%w: nil reader for %s", repository.ErrInvalid, d)
	}
	if info, err := r.statObject(ctx, r.blobKey(d)); err == nil {
		if size >= 0 && info.Size != size {
			return repository.BlobInfo{}, fmt.Errorf("%w: %s is stored with %d bytes, declared %d", repository.ErrDigestMismatch, d, info.Size, size)
		}
		if err := r.markUsed(ctx, d); err != nil {
			return repository.BlobInfo{}, err
		}
		return repository.BlobInfo{Digest: d, Size: info.Size, LastUsed: time.Now()}, nil
	} else if !errors.Is(err, repository.ErrNotFound) {
		return repository.BlobInfo{}, err
	}
	v := repository.NewVerifier(d, size)
	up, err := r.upload(ctx, d, size, repository.VerifyingReader(src, v))
	if err != nil {
		if verr := v.Check(); verr != nil {
			return repository.BlobInfo{}, fmt.Errorf("s3: put %s: %w", d, verr)
		}
		return repository.BlobInfo{}, fmt.Errorf("s3: put %s: %w", d, err)
	}
	if verr := v.Check(); verr != nil || up.Size != v.N() {
		// The uploader finished without reading to the end: never leave a
		// blob under a digest its bytes do not have.
		_ = r.c.RemoveObject(ctx, r.bucket, r.blobKey(d), minio.RemoveObjectOptions{})
		return repository.BlobInfo{}, fmt.Errorf("s3: put %s: %w (uploaded %d of %d bytes)", d, errors.Join(verr, repository.ErrDigestMismatch), up.Size, v.N())
	}
	return repository.BlobInfo{Digest: d, Size: up.Size, LastUsed: time.Now()}, nil
}

// upload sends the verified stream vr. Whether a bad blob could become
// visible must not depend on how a server treats a request body cut short
// (some store what arrived), so no request body is ever read from the
// stream: a blob of up to one part is read and verified in memory, then put
// in one request; a larger one goes multipart, each part buffered before it
// is sent, and the object appears only with CompleteMultipartUpload, which
// the verifier's failure on the last read prevents.
func (r *Repo) upload(ctx context.Context, d repository.Digest, size int64, vr io.Reader) (minio.UploadInfo, error) {
	key := r.blobKey(d)
	if size < 0 || uint64(size) <= r.part {
		buf, err := io.ReadAll(io.LimitReader(vr, int64(r.part)+1))
		if err != nil {
			return minio.UploadInfo{}, err
		}
		if uint64(len(buf)) <= r.part {
			return r.c.PutObject(ctx, r.bucket, key, bytes.NewReader(buf), int64(len(buf)), minio.PutObjectOptions{
				ContentType: "application/octet-stream", DisableMultipart: true,
			})
		}
		vr = io.MultiReader(bytes.NewReader(buf), vr) // unknown size, more than a part
	}
	// Parts come from memory, so the SigV4 payload hash (a second sha256
	// pass) is skipped; minio-go's CRC32C part checksums still protect the
	// transfer. Parts are filled in order and uploaded in parallel.
	return r.c.PutObject(ctx, r.bucket, key, vr, size, minio.PutObjectOptions{
		ContentType: "application/octet-stream", PartSize: r.part, DisableContentSha256: true,
		ConcurrentStreamParts: r.parallel > 1, NumThreads: r.parallel,
	})
}

func (r *Repo) markUsed(ctx context.Context, d repository.Digest) error {
	_, err := r.c.PutObject(ctx, r.bucket, r.usedKey(d), strings.NewReader(""), 0, minio.PutObjectOptions{DisableMultipart: true})
	if err != nil {
		return fmt.Errorf("s3: mark %s used: %w", d, err)
	}
	return nil
}

func (r *Repo) statObject(ctx context.Context, key string) (minio.ObjectInfo, error) {
	info, err := r.c.StatObject(ctx, r.bucket, key, minio.StatObjectOptions{})
	if err != nil {
		if isNotFound(err) {
			return info, fmt.Errorf("%w: %s", repository.ErrNotFound, key)
		}
		return info, fmt.Errorf("s3: stat %s: %w", key, err)
	}
	return info, nil
}

// GetBlob implements repository.Repository.
func (r *Repo) GetBlob(ctx context.Context, d repository.Digest) (io.ReadCloser, error) {
	if err := d.Validate(); err != nil {
		return nil, err
	}
	body, info, err := r.getObject(ctx, r.blobKey(d), minio.GetObjectOptions{})
	if err != nil {
		return nil, err
	}
	return repository.VerifyingReadCloser(body, d, info.Size), nil
}

// getObject is one GET (minio.Client.GetObject would HEAD first and then GET
// with If-Match, failing spuriously when the object is replaced in between).
func (r *Repo) getObject(ctx context.Context, key string, o minio.GetObjectOptions) (io.ReadCloser, minio.ObjectInfo, error) {
	body, info, _, err := minio.Core{Client: r.c}.GetObject(ctx, r.bucket, key, o)
	if err != nil {
		if isNotFound(err) {
			return nil, info, fmt.Errorf("%w: %s", repository.ErrNotFound, key)
		}
		return nil, info, fmt.Errorf("s3: get %s: %w", key, err)
	}
	return body, info, nil
}

// OpenBlob implements repository.Repository: one HEAD now, one ranged GET
// per ReadAt.
func (r *Repo) OpenBlob(ctx context.Context, d repository.Digest) (repository.BlobReader, error) {
	if err := d.Validate(); err != nil {
		return nil, err
	}
	info, err := r.statObject(ctx, r.blobKey(d))
	if err != nil {
		return nil, err
	}
	return &rangeReader{r: r, key: r.blobKey(d), size: info.Size}, nil
}

type rangeReader struct {
	r    *Repo
	key  string
	size int64
}

func (rr *rangeReader) Size() int64  { return rr.size }
func (rr *rangeReader) Close() error { return nil }

func (rr *rangeReader) ReadAt(ctx context.Context, p []byte, off int64) (int, error) {
	if off < 0 {
		return 0, fmt.Errorf("%w: negative offset %d", repository.ErrInvalid, off)
	}
	if off >= rr.size {
		return 0, io.EOF
	}
	want := p[:min(int64(len(p)), rr.size-off)]
	if len(want) == 0 {
		return 0, nil
	}
	var o minio.GetObjectOptions
	if err := o.SetRange(off, off+int64(len(want))-1); err != nil {
		return 0, fmt.Errorf("s3: %w", err)
	}
	body, _, err := rr.r.getObject(ctx, rr.key, o)
	if err != nil {
		return 0, err
	}
	defer body.Close()
	n, err := io.ReadFull(body, want)
	if err != nil {
		return n, fmt.Errorf("s3: range %s %d+%d: %w", rr.key, off, len(want), err)
	}
	if len(want) < len(p) {
		return n, io.EOF
	}
	return n, nil
}

// StatBlob implements repository.Repository.
func (r *Repo) StatBlob(ctx context.Context, d repository.Digest) (repository.BlobInfo, error) {
	if err := d.Validate(); err != nil {
		return repository.BlobInfo{}, err
	}
	info, err := r.statObject(ctx, r.blobKey(d))
	if err != nil {
		return repository.BlobInfo{}, err
	}
	last := info.LastModified
	if used, err := r.statObject(ctx, r.usedKey(d)); err == nil && used.LastModified.After(last) {
		last = used.LastModified
	} else if err != nil && !errors.Is(err, repository.ErrNotFound) {
		return repository.BlobInfo{}, err
	}
	return repository.BlobInfo{Digest: d, Size: info.Size, LastUsed: last}, nil
}

// DeleteBlob implements repository.Repository.
func (r *Repo) DeleteBlob(ctx context.Context, d repository.Digest) error {
	if err := d.Validate(); err != nil {
		return err
	}
	for _, key := range []string{r.blobKey(d), r.usedKey(d)} {
		if err := r.c.RemoveObject(ctx, r.bucket, key, minio.RemoveObjectOptions{}); err != nil && !isNotFound(err) {
			return fmt.Errorf("s3: delete %s: %w", key, err)
		}
	}
	return nil
}

// DeleteBlobIfUnused implements repository.Repository (check, then delete;
// see the package comment for the window this leaves).
func (r *Repo) DeleteBlobIfUnused(ctx context.Context, d repository.Digest, cutoff time.Time) error {
	info, err := r.StatBlob(ctx, d)
	if err != nil {
		return err
	}
	if !info.LastUsed.Before(cutoff) {
		return fmt.Errorf("%w: %s used at %s", repository.ErrInUse, d, info.LastUsed.UTC().Format(time.RFC3339Nano))
	}
	return r.DeleteBlob(ctx, d)
}

// WalkBlobs implements repository.Repository.
func (r *Repo) WalkBlobs(ctx context.Context, fn func(repository.BlobInfo) error) error {
	used := map[string]time.Time{}
	for obj := range r.c.ListObjectsIter(ctx, r.bucket, minio.ListObjectsOptions{Prefix: r.prefix + "blobs-used/sha256/", Recursive: true}) {
		if obj.Err != nil {
			return fmt.Errorf("s3: list: %w", obj.Err)
		}
		used[obj.Key[strings.LastIndexByte(obj.Key, '/')+1:]] = obj.LastModified
	}
	for obj := range r.c.ListObjectsIter(ctx, r.bucket, minio.ListObjectsOptions{Prefix: r.prefix + "blobs/sha256/", Recursive: true}) {
		if obj.Err != nil {
			return fmt.Errorf("s3: list: %w", obj.Err)
		}
		hex := obj.Key[strings.LastIndexByte(obj.Key, '/')+1:]
		d := repository.Digest("sha256:" + hex)
		if d.Validate() != nil {
			continue
		}
		last := obj.LastModified
		if u, ok := used[hex]; ok && u.After(last) {
			last = u
		}
		if err := fn(repository.BlobInfo{Digest: d, Size: obj.Size, LastUsed: last}); err != nil {
			return err
		}
	}
	return nil
}
