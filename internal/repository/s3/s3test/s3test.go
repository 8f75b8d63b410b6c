// Package s3test starts a real S3 server (versitygw with its posix backend
// in a temporary directory) on loopback for tests, and skips the test with
// the install command when the binary is missing.
package s3test

import (
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"syscall"
	"testing"
	"time"

	"github.com/minio/minio-go/v7"
	"github.com/minio/minio-go/v7/pkg/credentials"
)

// Keys of the single root account the server is started with.
const (
	AccessKey = "aenv-test-access"
	SecretKey = "aenv-test-secret-key"
)

// Server is a running versitygw.
type Server struct {
	Endpoint string // http://127.0.0.1:<port>
	Addr     string // 127.0.0.1:<port>
	Dir      string // backend directory; buckets are its subdirectories
	client   *minio.Client
}

// Binary finds versitygw: $AENV_VERSITYGW, then PATH, then $GOBIN and
// $GOPATH/bin (where scripts/s3-test-server.sh install puts it).
func Binary() (string, error) {
	if p := os.Getenv("AENV_VERSITYGW"); p != "" {
		return p, nil
	}
	if p, err := exec.LookPath("versitygw"); err == nil {
		return p, nil
	}
	var dirs []string
	if d := os.Getenv("GOBIN"); d != "" {
		dirs = append(dirs, d)
	}
	if d := os.Getenv("GOPATH"); d != "" {
		dirs = append(dirs, filepath.Join(d, "bin"))
	}
	if home, err := os.UserHomeDir(); err == nil {
		dirs = append(dirs, filepath.Join(home, "go", "bin"))
	}
	for _, d := range dirs {
		p := filepath.Join(d, "versitygw")
		if st, err := os.Stat(p); err == nil && st.Mode()&0o111 != 0 {
			return p, nil
		}
	}
	return "", fmt.Errorf("versitygw not found (set AENV_VERSITYGW, or run scripts/s3-test-server.sh install)")
}

// Start runs a server for the test's lifetime; it is killed (with its process
// group) at cleanup, and by the kernel if the test binary dies first.
func Start(t testing.TB) *Server {
	t.Helper()
	bin, err := Binary()
	if err != nil {
		t.Skipf("no real S3 server: %v", err)
	}
	dir := t.TempDir()
	for attempt := 0; ; attempt++ {
		s, err := start(t, bin, dir)
		if err == nil {
			return s
		}
		if attempt == 2 {
			t.Fatalf("start versitygw: %v", err)
		}
	}
}

func start(t testing.TB, bin, dir string) (*Server, error) {
	port, err := freePort()
	if err != nil {
		return nil, err
	}
	addr := net.JoinHostPort("127.0.0.1", strconv.Itoa(port))
	// --virtual-domain localhost also serves bucket.localhost host names, so
	// virtual-host addressing can be tested against loopback.
	cmd := exec.Command(bin, "--access", AccessKey, "--secret", SecretKey, "--port", addr, "--quiet",
		"--virtual-domain", "localhost", "posix", dir)
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	logPath := filepath.Join(t.TempDir(), "versitygw.log")
	logf, err := os.Create(logPath)
	if err != nil {
		return nil, err
	}
	cmd.Stdout, cmd.Stderr = logf, logf
	if err := cmd.Start(); err != nil {
		logf.Close()
		return nil, err
	}
	exited := make(chan struct{})
	go func() { _ = cmd.Wait(); close(exited) }()
	stop := func() {
		_ = syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
		<-exited
		logf.Close()
	}
	c, err := minio.New(addr, &minio.Options{Creds: credentials.NewStaticV4(AccessKey, SecretKey, ""), BucketLookup: minio.BucketLookupPath})
	if err != nil {
		stop()
		return nil, err
	}
	deadline := time.Now().Add(15 * time.Second)
	for {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		_, err = c.ListBuckets(ctx)
		cancel()
		if err == nil {
			break
		}
		select {
		case <-exited:
			b, _ := os.ReadFile(logPath)
			return nil, fmt.Errorf("versitygw exited: %s", b)
		default:
		}
		if time.Now().After(deadline) {
			stop()
			return nil, fmt.Errorf("versitygw not ready on %s: %w", addr, err)
		}
		time.Sleep(50 * time.Millisecond)
	}
	t.Cleanup(stop)
	return &Server{Endpoint: "http://" + addr, Addr: addr, Dir: dir, client: c}, nil
}

func freePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}

// Bucket creates a bucket with a unique name and returns it.
func (s *Server) Bucket(t testing.TB) string {
	t.Helper()
	name := fmt.Sprintf("aenv-%d", time.Now().UnixNano())
	if err := s.client.MakeBucket(context.Background(), name, minio.MakeBucketOptions{}); err != nil {
		t.Fatalf("make bucket: %v", err)
	}
	return name
}
