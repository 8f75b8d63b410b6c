package config

import (
	"path/filepath"
	"regexp"
	"strings"
	"unicode"
)

// bucketPattern is S3's bucket naming rule (lowercase, digits, dots, hyphens).
var bucketPattern = regexp.MustCompile(`^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$`)

// regionPattern accepts AWS-style and custom region names.
var regionPattern = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$`)

// validateRepository checks the [snapshot] and [repository] sections.
func (c *Config) validateRepository(bad func(key, format string, args ...any)) {
	s := c.Snapshot
	switch s.RepositoryBackend {
	case "posix_fs", "s3":
	default:
		bad("snapshot.repository_backend", "%q is not posix_fs or s3", s.RepositoryBackend)
	}
	// stack.DefaultMaxDepth's format limit: tags are a u8 and one is the upper.
	if s.MaxDepth < 2 || s.MaxDepth > 254 {
		bad("snapshot.max_depth", "must be between 2 and 254, got %d", s.MaxDepth)
	}
	if s.PublishWorkers < 1 || s.PublishWorkers > 256 {
		bad("snapshot.publish_workers", "must be between 1 and 256, got %d", s.PublishWorkers)
	}
	if s.SyncInterval.Duration <= 0 {
		bad("snapshot.sync_interval", "must be positive, got %s", s.SyncInterval)
	}
	if s.GCGrace.Duration < 0 {
		bad("snapshot.gc_grace", "must not be negative, got %s", s.GCGrace)
	}
	// The same names as oci.QuiesceFreeze/QuiesceSync; checked here so a typo fails at load
	// with the key's name rather than when the backend starts.
	switch s.Quiesce {
	case "freeze", "sync":
	default:
		bad("snapshot.quiesce", "%q is not freeze or sync", s.Quiesce)
	}

	r := &c.Repository
	for key, p := range map[string]*string{"repository.posix_fs.path": &r.PosixFS.Path, "repository.cache.dir": &r.Cache.Dir,
		"repository.block_cache.dir": &r.BlockCache.Dir} {
		if *p == "" {
			continue
		}
		if hasControl(*p) {
			bad(key, "contains control characters")
			continue
		}
		if !filepath.IsAbs(*p) {
			abs, err := filepath.Abs(*p)
			if err != nil {
				bad(key, "%v", err)
				continue
			}
			*p = abs
		}
	}
	s3 := r.S3
	for key, v := range map[string]string{"repository.s3.endpoint": s3.Endpoint, "repository.s3.prefix": s3.Prefix,
		"repository.s3.access_key": s3.AccessKey, "repository.s3.secret_key": s3.SecretKey} {
		if hasControl(v) {
			bad(key, "contains control characters")
		}
	}
	if s3.Bucket != "" && !bucketPattern.MatchString(s3.Bucket) {
		bad("repository.s3.bucket", "%q is not a valid S3 bucket name", s3.Bucket)
	}
	if s3.Region != "" && !regionPattern.MatchString(s3.Region) {
		bad("repository.s3.region", "%q is not a region name", s3.Region)
	}
	switch s3.Addressing {
	case "auto", "path", "virtual":
	default:
		bad("repository.s3.addressing", "%q is not auto, path or virtual", s3.Addressing)
	}
	if strings.Contains(s3.Prefix, "//") || strings.Contains("/"+strings.Trim(s3.Prefix, "/")+"/", "/../") {
		bad("repository.s3.prefix", "%q has an empty or '..' segment", s3.Prefix)
	}
	if (s3.AccessKey == "") != (s3.SecretKey == "") {
		bad("repository.s3.access_key", "access_key and secret_key must be set together (or both empty for environment credentials)")
	}
	if s.RepositoryBackend == "s3" && (s3.Endpoint == "" || s3.Bucket == "") {
		bad("repository.s3.bucket", "repository_backend s3 needs repository.s3.endpoint and repository.s3.bucket")
	}
	cc := r.Cache
	if cc.MaxSizeGB < 1 {
		bad("repository.cache.max_size_gb", "must be at least 1, got %d", cc.MaxSizeGB)
	}
	if !(cc.HighWatermark > 0 && cc.HighWatermark <= 1) {
		bad("repository.cache.high_watermark", "must be in (0, 1], got %g", cc.HighWatermark)
	}
	if !(cc.LowWatermark > 0 && cc.LowWatermark <= cc.HighWatermark) {
		bad("repository.cache.low_watermark", "must be in (0, high_watermark], got %g", cc.LowWatermark)
	}
	bc := r.BlockCache
	if bc.MaxSizeGB < 1 {
		bad("repository.block_cache.max_size_gb", "must be at least 1, got %d", bc.MaxSizeGB)
	}
	if bc.BlockSizeKB < 4 || bc.BlockSizeKB > 16384 || bc.BlockSizeKB&(bc.BlockSizeKB-1) != 0 {
		bad("repository.block_cache.block_size_kb", "must be a power of two between 4 and 16384, got %d", bc.BlockSizeKB)
	}
	if bc.Readahead < 0 || bc.Readahead > 64 {
		bad("repository.block_cache.readahead", "must be between 0 and 64, got %d", bc.Readahead)
	}
	if !(bc.HighWatermark > 0 && bc.HighWatermark <= 1) {
		bad("repository.block_cache.high_watermark", "must be in (0, 1], got %g", bc.HighWatermark)
	}
	if !(bc.LowWatermark > 0 && bc.LowWatermark <= bc.HighWatermark) {
		bad("repository.block_cache.low_watermark", "must be in (0, high_watermark], got %g", bc.LowWatermark)
	}
}

func hasControl(s string) bool {
	return strings.ContainsFunc(s, unicode.IsControl)
}
