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
	bin      string
	client   *minio.Client
	stop     func()
}

// Binary finds versitygw: $AENV_VERSITYGW, then PATH, then $GOBIN and
// $GOPATH/bin (where scripts/s3-test-server.sh install puts it).
func Binary() (string, error) {
	if p := os.Getenv("AENV_VERSITYGW"); p != "" {
		if st, err := os.Stat(p); err != nil || st.Mode()&0o111 == 0 {
			return "", fmt.Errorf("AENV_VERSITYGW=%s is not an executable", p)
		}
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
		port, err := freePort()
		if err != nil {
			t.Fatal(err)
		}
		s := &Server{Dir: dir, bin: bin, Addr: net.JoinHostPort("127.0.0.1", strconv.Itoa(port))}
		s.Endpoint = "http://" + s.Addr
		if err = s.start(t); err == nil {
			t.Cleanup(func() { s.Kill() })
			return s
		}
		if attempt == 2 {
			t.Fatalf("start versitygw: %v", err)
		}
	}
}

// Kill stops the server abruptly (SIGKILL), as a crash or a network cut
// would; Restart brings it back on the same address and data.
func (s *Server) Kill() {
	if s.stop != nil {
		s.stop()
		s.stop = nil
	}
}

// Restart starts the server again after Kill.
func (s *Server) Restart(t testing.TB) {
	t.Helper()
	s.Kill()
	if err := s.start(t); err != nil {
		t.Fatalf("restart versitygw: %v", err)
	}
}

func (s *Server) start(t testing.TB) error {
	// --virtual-domain localhost also serves bucket.localhost host names, so
	// virtual-host addressing can be tested against loopback.
	cmd := exec.Command(s.bin, "--access", AccessKey, "--secret", SecretKey, "--port", s.Addr, "--quiet",
		"--virtual-domain", "localhost", "posix", s.Dir)
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	logPath := filepath.Join(t.TempDir(), "versitygw.log")
	logf, err := os.Create(logPath)
	if err != nil {
		return err
	}
	cmd.Stdout, cmd.Stderr = logf, logf
	if err := cmd.Start(); err != nil {
		logf.Close()
		return err
	}
	exited := make(chan struct{})
	go func() { _ = cmd.Wait(); close(exited) }()
	stop := func() {
		_ = syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
		<-exited
		logf.Close()
	}
	c, err := minio.New(s.Addr, &minio.Options{Creds: credentials.NewStaticV4(AccessKey, SecretKey, ""), BucketLookup: minio.BucketLookupPath})
	if err != nil {
		stop()
		return err
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
			logf.Close()
			return fmt.Errorf("versitygw exited: %s", b)
		default:
		}
		if time.Now().After(deadline) {
			stop()
			return fmt.Errorf("versitygw not ready on %s: %w", s.Addr, err)
		}
		time.Sleep(50 * time.Millisecond)
	}
	s.client, s.stop = c, stop
	return nil
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
