package config

import (
	"path/filepath"
	"strings"
	"testing"
	"time"
)

func TestRepositoryDefaults(t *testing.T) {
	c, err := Load("", envFrom(map[string]string{"AENV_DATA_DIR": "/srv/aenv"}))
	if err != nil {
		t.Fatal(err)
	}
	s := c.Snapshot
	if s.RepositoryBackend != "posix_fs" || s.MaxDepth != 32 || s.PublishWorkers != 4 ||
		s.SyncInterval.Duration != 30*time.Second || s.GCGrace.Duration != 15*time.Minute || s.Quiesce != "freeze" {
		t.Fatalf("snapshot defaults %+v", s)
	}
	if c.RepositoryPath() != "/srv/aenv/repository" || c.RepositoryCacheDir() != "/srv/aenv/repository-cache" {
		t.Fatalf("paths %s %s", c.RepositoryPath(), c.RepositoryCacheDir())
	}
	r := c.Repository
	if r.S3.Addressing != "auto" || r.Cache.MaxSizeGB != 50 || r.Cache.HighWatermark != 0.9 || r.Cache.LowWatermark != 0.7 {
		t.Fatalf("repository defaults %+v", r)
	}
}

func TestRepositoryFromFileAndEnv(t *testing.T) {
	path := writeFile(t, `
[snapshot]
repository_backend = "s3"
max_depth = 8
[repository.s3]
endpoint = "http://127.0.0.1:7070"
bucket = "aenv-snapshots"
prefix = "prod/a"
addressing = "path"
access_key = "AK"
secret_key = "SK"
[repository.cache]
dir = "cache"
`)
	c, err := Load(path, envFrom(map[string]string{
		"AENV_REPOSITORY_CACHE_HIGH_WATERMARK": "0.95", "AENV_SNAPSHOT_SYNC_INTERVAL": "5s",
		"AENV_REPOSITORY_POSIX_FS_PATH": "/mnt/nfs/aenv", "AENV_REPOSITORY_S3_REGION": "eu-west-1",
		"AENV_SNAPSHOT_QUIESCE": "sync",
	}))
	if err != nil {
		t.Fatal(err)
	}
	s3 := c.Repository.S3
	if c.Snapshot.RepositoryBackend != "s3" || c.Snapshot.MaxDepth != 8 || s3.Endpoint != "http://127.0.0.1:7070" ||
		s3.Bucket != "aenv-snapshots" || s3.Prefix != "prod/a" || s3.Addressing != "path" || s3.AccessKey != "AK" ||
		s3.SecretKey != "SK" || s3.Region != "eu-west-1" || c.Snapshot.Quiesce != "sync" {
		t.Fatalf("s3 settings %+v %+v", c.Snapshot, s3)
	}
	if c.Repository.Cache.HighWatermark != 0.95 || c.Snapshot.SyncInterval.Duration != 5*time.Second ||
		c.RepositoryPath() != "/mnt/nfs/aenv" || !filepath.IsAbs(c.RepositoryCacheDir()) {
		t.Fatalf("overrides: %+v path %s cache %s", c.Repository.Cache, c.RepositoryPath(), c.RepositoryCacheDir())
	}
}

func TestRepositoryErrorsNameTheKey(t *testing.T) {
	for _, tc := range []struct {
		env map[string]string
		key string
	}{
		{map[string]string{"AENV_SNAPSHOT_REPOSITORY_BACKEND": "oss"}, "snapshot.repository_backend"},
		{map[string]string{"AENV_SNAPSHOT_MAX_DEPTH": "1"}, "snapshot.max_depth"},
		{map[string]string{"AENV_SNAPSHOT_MAX_DEPTH": "255"}, "snapshot.max_depth"},
		{map[string]string{"AENV_SNAPSHOT_PUBLISH_WORKERS": "0"}, "snapshot.publish_workers"},
		{map[string]string{"AENV_SNAPSHOT_SYNC_INTERVAL": "0s"}, "snapshot.sync_interval"},
		{map[string]string{"AENV_SNAPSHOT_GC_GRACE": "-1m"}, "snapshot.gc_grace"},
		{map[string]string{"AENV_SNAPSHOT_REPOSITORY_BACKEND": "s3"}, "repository.s3.bucket"},
		{map[string]string{"AENV_REPOSITORY_S3_BUCKET": "Bad_Bucket"}, "repository.s3.bucket"},
		{map[string]string{"AENV_REPOSITORY_S3_ADDRESSING": "dns"}, "repository.s3.addressing"},
		{map[string]string{"AENV_REPOSITORY_S3_PREFIX": "a/../b"}, "repository.s3.prefix"},
		{map[string]string{"AENV_REPOSITORY_S3_ACCESS_KEY": "only-half"}, "repository.s3.access_key"},
		{map[string]string{"AENV_REPOSITORY_CACHE_MAX_SIZE_GB": "0"}, "repository.cache.max_size_gb"},
		{map[string]string{"AENV_REPOSITORY_CACHE_HIGH_WATERMARK": "1.5"}, "repository.cache.high_watermark"},
		{map[string]string{"AENV_REPOSITORY_CACHE_HIGH_WATERMARK": "x"}, "AENV_REPOSITORY_CACHE_HIGH_WATERMARK"},
		{map[string]string{"AENV_REPOSITORY_CACHE_LOW_WATERMARK": "0.95"}, "repository.cache.low_watermark"},
		{map[string]string{"AENV_REPOSITORY_POSIX_FS_PATH": "/a\nb"}, "repository.posix_fs.path"},
	} {
		_, err := Load("", envFrom(tc.env))
		if err == nil || !strings.Contains(err.Error(), tc.key) {
			t.Errorf("%v: err %v does not name %s", tc.env, err, tc.key)
		}
	}
}
