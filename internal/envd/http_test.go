package envd_test

import (
	"bytes"
	"compress/gzip"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"io"
	"mime/multipart"
	"net/http"
	"net/textproto"
	"net/url"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"connectrpc.com/connect"
	"golang.org/x/sys/unix"

	"github.com/aenv-dev/aenv/internal/envd"
	"github.com/aenv-dev/aenv/internal/envd/files"
	"github.com/aenv-dev/aenv/internal/envd/filesystem"
	fspb "github.com/aenv-dev/aenv/internal/envd/gen/filesystem"
	pb "github.com/aenv-dev/aenv/internal/envd/gen/process"
)

func (e *env) do(method, path string, body io.Reader, hdr map[string]string) (*http.Response, []byte) {
	e.t.Helper()
	req, err := http.NewRequest(method, e.url+path, body)
	if err != nil {
		e.t.Fatal(err)
	}
	for k, v := range hdr {
		req.Header.Set(k, v)
	}
	tr := &http.Transport{DisableCompression: true}
	resp, err := (&http.Client{Transport: tr}).Do(req)
	if err != nil {
		e.t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp, b
}

func wantJSONError(t *testing.T, resp *http.Response, body []byte, status int) {
	t.Helper()
	var v struct {
		Code    int    `json:"code"`
		Message string `json:"message"`
	}
	if resp.StatusCode != status || json.Unmarshal(body, &v) != nil || v.Code != status || v.Message == "" {
		t.Fatalf("want %d JSON error, got %d %q", status, resp.StatusCode, body)
	}
}

func TestHealth(t *testing.T) {
	e := newEnv(t, envOpts{token: "tok"})
	resp, body := e.do("GET", "/health", nil, nil) // exempt from the token
	if resp.StatusCode != 204 || len(body) != 0 || resp.Header.Get("Cache-Control") != "no-store" || resp.Header.Get("X-Envd-Version") != envd.Version {
		t.Fatalf("%d %v", resp.StatusCode, resp.Header)
	}
	resp, body = e.do("GET", "/nope", nil, nil)
	wantJSONError(t, resp, body, 404)
}

func TestInitTokenUserWorkdirEnv(t *testing.T) {
	e := newEnv(t, envOpts{})
	post := func(body string, hdr map[string]string) (*http.Response, []byte) {
		return e.do("POST", "/init", strings.NewReader(body), hdr)
	}
	// Exact shape the orchestrator sends.
	ts := time.Now().UTC()
	resp, body := post(fmt.Sprintf(`{"envVars":{"K":"V"},"accessToken":"secret","defaultUser":"root","defaultWorkdir":"/tmp","timestamp":%q,"volumeMounts":[],"hyperloopIP":"","lifecycleID":"x"}`, ts.Format(time.RFC3339Nano)), nil)
	if resp.StatusCode != 204 || resp.Header.Get("X-Envd-Version") != envd.Version {
		t.Fatalf("%d %s", resp.StatusCode, body)
	}
	// Now the token is required everywhere but /health and (signed) /files.
	resp, body = e.do("GET", "/envs", nil, nil)
	wantJSONError(t, resp, body, 401)
	resp, body = e.do("GET", "/envs", nil, map[string]string{"X-Access-Token": "wrong"})
	wantJSONError(t, resp, body, 401)
	resp, body = e.do("GET", "/envs", nil, map[string]string{"X-Access-Token": "secret"})
	var envs map[string]string
	if resp.StatusCode != 200 || json.Unmarshal(body, &envs) != nil || envs["K"] != "V" || envs["E2B_SANDBOX"] != "true" {
		t.Fatalf("%d %s", resp.StatusCode, body)
	}
	// RPC without the token: Connect unauthenticated.
	_, err := e.proc.List(t.Context(), connect.NewRequest(&pb.ListRequest{}))
	if codeOf(err) != connect.CodeUnauthenticated {
		t.Fatalf("rpc without token: %v", err)
	}
	e.token = "secret"
	r := e.run(t.Context(), "echo $K; pwd; id -u")
	if string(r.stdout) != fmt.Sprintf("V\n/tmp\n%d\n", os.Geteuid()) {
		t.Fatalf("after init: %q %v", r.stdout, r.err)
	}
	// Re-init needs the current token; a stale timestamp changes nothing.
	resp, body = post(`{"accessToken":"other"}`, nil)
	wantJSONError(t, resp, body, 401)
	resp, _ = post(fmt.Sprintf(`{"envVars":{"K":"old"},"timestamp":%q}`, ts.Add(-time.Hour).Format(time.RFC3339)), map[string]string{"X-Access-Token": "secret"})
	if resp.StatusCode != 204 {
		t.Fatal(resp.StatusCode)
	}
	if _, body = e.do("GET", "/envs", nil, map[string]string{"X-Access-Token": "secret"}); !strings.Contains(string(body), `"K":"V"`) {
		t.Fatalf("stale init applied: %s", body)
	}
	resp, body = post(`{"defaultUser":"ghost"}`, map[string]string{"X-Access-Token": "secret"})
	wantJSONError(t, resp, body, 400)
	resp, body = post(`{"envVars":`, map[string]string{"X-Access-Token": "secret"})
	wantJSONError(t, resp, body, 400)
	resp, _ = post(``, map[string]string{"X-Access-Token": "secret"})
	if resp.StatusCode != 204 {
		t.Fatalf("empty init: %d", resp.StatusCode)
	}
	resp, body = e.do("GET", "/init", nil, nil)
	wantJSONError(t, resp, body, 405)
}

// TestInitEntropy: /init with entropy reseeds the kernel's random generator, which only
// root may do; envd answers 500 rather than leave a restored sandbox's generator as its
// siblings' (the microvm package shows the effect on forks).
func TestInitEntropy(t *testing.T) {
	e := newEnv(t, envOpts{})
	entropy := base64.StdEncoding.EncodeToString(bytes.Repeat([]byte{7}, 32))
	resp, body := e.do("POST", "/init", strings.NewReader(fmt.Sprintf(`{"entropy":%q}`, entropy)), nil)
	if os.Geteuid() != 0 {
		wantJSONError(t, resp, body, 500)
		return
	}
	if resp.StatusCode != 204 {
		t.Fatalf("init with entropy as root: %d %s", resp.StatusCode, body)
	}
	resp, body = e.do("POST", "/init", strings.NewReader(`{"entropy":"not base64"}`), nil)
	wantJSONError(t, resp, body, 400)
}

// TestInitEntropyFailureChangesNothing: an /init whose reseed fails answers 500 and applies
// none of the body (here the random device is a plain file, which takes the bytes but not
// the reseed ioctl): the node does not go on with a sandbox sharing its siblings' random
// numbers, and its retry meets envd as it was.
func TestInitEntropyFailureChangesNothing(t *testing.T) {
	dev := filepath.Join(t.TempDir(), "urandom")
	if err := os.WriteFile(dev, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	e := newEnv(t, envOpts{randomDevice: dev})
	raw := bytes.Repeat([]byte{7}, 32)
	body := fmt.Sprintf(`{"accessToken":"tok-1","envVars":{"A":"1"},"entropy":%q}`, base64.StdEncoding.EncodeToString(raw))
	resp, out := e.do("POST", "/init", strings.NewReader(body), nil)
	wantJSONError(t, resp, out, 500)
	if got, _ := os.ReadFile(dev); !bytes.Equal(got, raw) {
		t.Fatalf("the random device got %x, want the body's entropy", got)
	}
	// No token was set: an /init without one is still accepted.
	resp, out = e.do("POST", "/init", strings.NewReader(`{}`), nil)
	if resp.StatusCode != 204 {
		t.Fatalf("/init after the failed one: %d %s (the failed one applied its token)", resp.StatusCode, out)
	}
}

func TestMetrics(t *testing.T) {
	e := newEnv(t, envOpts{})
	resp, body := e.do("GET", "/metrics", nil, nil)
	var m map[string]any
	if resp.StatusCode != 200 || json.Unmarshal(body, &m) != nil {
		t.Fatalf("%d %s", resp.StatusCode, body)
	}
	for _, k := range []string{"ts", "cpu_count", "cpu_used_pct", "mem_total", "mem_used", "mem_cache", "mem_total_mib", "mem_used_mib", "disk_used", "disk_total"} {
		if _, ok := m[k].(float64); !ok {
			t.Errorf("%s missing in %s", k, body)
		}
	}
	if m["cpu_count"].(float64) < 1 || m["mem_total"].(float64) <= 0 || m["disk_total"].(float64) <= 0 {
		t.Fatalf("implausible %s", body)
	}
}

// Test vectors from e2b-protocol.md 2.5.
func TestSignatureVectors(t *testing.T) {
	if got := files.Sign("/home/user/hello.txt", "read", "", "envd-token-xyz", nil); got != "v1_uJVyV4+iuu8jC1Pc5vfC3iV6nFJtAmDNwSzE7IuT5x0" {
		t.Fatal(got)
	}
	exp := int64(1700000000)
	if got := files.Sign("/home/user/hello.txt", "write", "user", "envd-token-xyz", &exp); got != "v1_DMBXHZcHMC8VksbQVFN9lNv5L/cGErLXpAOJokN3X3M" {
		t.Fatal(got)
	}
}

func multipartBody(t *testing.T, parts map[string]string, order []string, field string) (string, *bytes.Buffer) {
	t.Helper()
	var buf bytes.Buffer
	mw := multipart.NewWriter(&buf)
	_ = mw.WriteField("other", "ignored")
	for _, name := range order {
		h := textproto.MIMEHeader{}
		h.Set("Content-Disposition", fmt.Sprintf(`form-data; name=%q; filename=%q`, field, name))
		h.Set("Content-Type", "application/octet-stream")
		w, _ := mw.CreatePart(h)
		_, _ = io.WriteString(w, parts[name])
	}
	_ = mw.Close()
	return mw.FormDataContentType(), &buf
}

func TestFilesUploadDownload(t *testing.T) {
	e := newEnv(t, envOpts{})
	// Single multipart file with ?path.
	ct, body := multipartBody(t, map[string]string{"x": "hello world"}, []string{"x"}, "file")
	resp, b := e.do("POST", "/files?path="+url.QueryEscape("docs/hello.txt"), body, map[string]string{"Content-Type": ct})
	var written []files.WrittenFile
	if resp.StatusCode != 200 || json.Unmarshal(b, &written) != nil || len(written) != 1 || written[0].Metadata != nil ||
		written[0].Path != filepath.Join(e.home, "docs/hello.txt") || written[0].Name != "hello.txt" || written[0].Type != "file" {
		t.Fatalf("%d %s", resp.StatusCode, b)
	}
	fi, _ := os.Stat(filepath.Join(e.home, "docs"))
	if isRoot() && fi.Sys().(*syscall.Stat_t).Uid != testUID {
		t.Fatal("parent not owned by the user")
	}
	fi, _ = os.Stat(filepath.Join(e.home, "docs/hello.txt"))
	if isRoot() && fi.Sys().(*syscall.Stat_t).Uid != testUID {
		t.Fatal("file not owned by the user")
	}

	// Multiple files, names carry (relative) paths; overwriting truncates.
	ct, body = multipartBody(t, map[string]string{"/tmp/" + filepath.Base(e.dir) + "-abs.txt": "A", "rel/dir/b.txt": "B", "docs/hello.txt": "short"},
		[]string{"/tmp/" + filepath.Base(e.dir) + "-abs.txt", "rel/dir/b.txt", "docs/hello.txt"}, "file")
	resp, b = e.do("POST", "/files", body, map[string]string{"Content-Type": ct})
	if resp.StatusCode != 200 || !strings.Contains(string(b), filepath.Join(e.home, "rel/dir/b.txt")) {
		t.Fatalf("%d %s", resp.StatusCode, b)
	}
	defer os.Remove("/tmp/" + filepath.Base(e.dir) + "-abs.txt")
	for p, want := range map[string]string{"docs/hello.txt": "short", "rel/dir/b.txt": "B", "/tmp/" + filepath.Base(e.dir) + "-abs.txt": "A"} {
		resp, b := e.do("GET", "/files?path="+url.QueryEscape(p), nil, nil)
		if resp.StatusCode != 200 || string(b) != want {
			t.Fatalf("%s: %d %q", p, resp.StatusCode, b)
		}
	}

	// Octet-stream, plain and gzip.
	resp, b = e.do("POST", "/files?path=raw.bin", strings.NewReader("raw bytes"), map[string]string{"Content-Type": "application/octet-stream"})
	if resp.StatusCode != 200 {
		t.Fatalf("%d %s", resp.StatusCode, b)
	}
	var gz bytes.Buffer
	zw := gzip.NewWriter(&gz)
	_, _ = zw.Write([]byte("zipped content"))
	_ = zw.Close()
	resp, b = e.do("POST", "/files?path=z.txt", &gz, map[string]string{"Content-Type": "application/octet-stream", "Content-Encoding": "gzip"})
	if resp.StatusCode != 200 {
		t.Fatalf("%d %s", resp.StatusCode, b)
	}
	if _, b := e.do("GET", "/files?path=z.txt", nil, nil); string(b) != "zipped content" {
		t.Fatalf("%q", b)
	}

	// Download details: gzip only when asked for alone, ranges, Content-Disposition.
	resp, b = e.do("GET", "/files?path=z.txt", nil, map[string]string{"Accept-Encoding": "gzip"})
	if resp.Header.Get("Content-Encoding") != "gzip" {
		t.Fatalf("no gzip: %v", resp.Header)
	}
	zr, err := gzip.NewReader(bytes.NewReader(b))
	if err != nil {
		t.Fatal(err)
	}
	if plain, _ := io.ReadAll(zr); string(plain) != "zipped content" {
		t.Fatalf("%q", plain)
	}
	resp, b = e.do("GET", "/files?path=z.txt", nil, map[string]string{"Accept-Encoding": "gzip, deflate"})
	if resp.Header.Get("Content-Encoding") != "" || string(b) != "zipped content" || resp.Header.Get("Content-Length") != "14" {
		t.Fatalf("undici default should get identity: %v %q", resp.Header, b)
	}
	resp, b = e.do("GET", "/files?path=z.txt", nil, map[string]string{"Accept-Encoding": "br, identity;q=0"})
	wantJSONError(t, resp, b, 406)
	resp, b = e.do("GET", "/files?path=z.txt", nil, map[string]string{"Range": "bytes=7-13"})
	if resp.StatusCode != 206 || string(b) != "content" {
		t.Fatalf("range: %d %q", resp.StatusCode, b)
	}
	if cd := resp.Header.Get("Content-Disposition"); cd != `inline; filename=z.txt` {
		t.Fatalf("content-disposition %q", cd)
	}
	resp, _ = e.do("GET", "/files?path=z.txt", nil, map[string]string{"If-Modified-Since": time.Now().Add(time.Hour).UTC().Format(http.TimeFormat)})
	if resp.StatusCode != 304 {
		t.Fatalf("conditional: %d", resp.StatusCode)
	}
	// Empty file: Content-Length 0.
	_ = os.WriteFile(filepath.Join(e.home, "empty"), nil, 0o644)
	if resp, b := e.do("GET", "/files?path=empty", nil, nil); resp.StatusCode != 200 || len(b) != 0 || resp.Header.Get("Content-Length") != "0" {
		t.Fatalf("empty: %d %v", resp.StatusCode, resp.Header)
	}
}

func TestFilesErrors(t *testing.T) {
	e := newEnv(t, envOpts{})
	resp, b := e.do("GET", "/files?path=missing.txt", nil, nil)
	wantJSONError(t, resp, b, 404)
	if !strings.Contains(string(b), "does not exist") {
		t.Fatal(string(b))
	}
	resp, b = e.do("GET", "/files?path=/tmp", nil, nil)
	wantJSONError(t, resp, b, 400)
	resp, b = e.do("GET", "/files?path=x&username=ghost", nil, nil)
	wantJSONError(t, resp, b, 401)
	resp, b = e.do("PUT", "/files?path=x", nil, nil)
	wantJSONError(t, resp, b, 405)

	ct, body := multipartBody(t, map[string]string{"a": "1"}, []string{"a"}, "file")
	resp, b = e.do("POST", "/files?path=/tmp", body, map[string]string{"Content-Type": ct})
	wantJSONError(t, resp, b, 400) // directory target
	ct, body = multipartBody(t, map[string]string{"d1.txt": "1"}, []string{"d1.txt", "d1.txt"}, "file")
	resp, b = e.do("POST", "/files", body, map[string]string{"Content-Type": ct})
	wantJSONError(t, resp, b, 400) // duplicate
	ct, body = multipartBody(t, map[string]string{"a": "1"}, []string{"a"}, "notfile")
	resp, b = e.do("POST", "/files?path=a", body, map[string]string{"Content-Type": ct})
	wantJSONError(t, resp, b, 400) // no part named file
	resp, b = e.do("POST", "/files?path=a", strings.NewReader("x"), map[string]string{"Content-Type": "text/plain"})
	wantJSONError(t, resp, b, 400)
	resp, b = e.do("POST", "/files", strings.NewReader("x"), map[string]string{"Content-Type": "application/octet-stream"})
	wantJSONError(t, resp, b, 400) // octet-stream without path
	resp, b = e.do("POST", "/files?path=a", strings.NewReader("not gzip"), map[string]string{"Content-Type": "application/octet-stream", "Content-Encoding": "gzip"})
	wantJSONError(t, resp, b, 400)
	resp, b = e.do("POST", "/files?path=a", strings.NewReader("x"), map[string]string{"Content-Type": "application/octet-stream", "Content-Encoding": "br"})
	wantJSONError(t, resp, b, 400)
	resp, b = e.do("POST", "/files?path=a", strings.NewReader("--b\r\nContent-Disposition: form-data; name=\"file\"; filename=\"x\"\r\n\r\ntruncated"), map[string]string{"Content-Type": "multipart/form-data; boundary=b"})
	wantJSONError(t, resp, b, 400) // truncated multipart
	_ = os.WriteFile(filepath.Join(e.home, "plainfile"), []byte("x"), 0o644)
	resp, b = e.do("POST", "/files?path=plainfile/child", strings.NewReader("x"), map[string]string{"Content-Type": "application/octet-stream"})
	wantJSONError(t, resp, b, 400) // parent is a file
}

// A full disk is a 507 (E2B's NotEnoughSpaceError). Needs root to mount a tiny tmpfs.
func TestFilesDiskFull(t *testing.T) {
	if !isRoot() {
		t.Skip("needs root to mount a small tmpfs")
	}
	e := newEnv(t, envOpts{})
	mnt := filepath.Join(e.dir, "small")
	_ = os.Mkdir(mnt, 0o755)
	if err := syscall.Mount("tmpfs", mnt, "tmpfs", 0, "size=64k"); err != nil {
		t.Skipf("cannot mount tmpfs: %v", err)
	}
	defer syscall.Unmount(mnt, syscall.MNT_DETACH)
	resp, b := e.do("POST", "/files?path="+url.QueryEscape(mnt+"/big"), bytes.NewReader(make([]byte, 1<<20)), map[string]string{"Content-Type": "application/octet-stream"})
	wantJSONError(t, resp, b, 507)
}

func TestFilesAuthAndSignatures(t *testing.T) {
	e := newEnv(t, envOpts{token: "tok"})
	_ = os.WriteFile(filepath.Join(e.home, "s.txt"), []byte("signed"), 0o644)
	get := func(q url.Values, hdr map[string]string) (*http.Response, []byte) {
		return e.do("GET", "/files?"+q.Encode(), nil, hdr)
	}
	q := url.Values{"path": {"s.txt"}}
	resp, b := get(q, nil)
	wantJSONError(t, resp, b, 401)
	if resp, _ := get(q, map[string]string{"X-Access-Token": "tok"}); resp.StatusCode != 200 {
		t.Fatal(resp.StatusCode)
	}
	q.Set("signature", files.Sign("s.txt", "read", "", "tok", nil))
	if resp, b := get(q, nil); resp.StatusCode != 200 || string(b) != "signed" {
		t.Fatal(resp.StatusCode)
	}
	// A wrong header token does not block a valid signature.
	if resp, _ := get(q, map[string]string{"X-Access-Token": "wrong"}); resp.StatusCode != 200 {
		t.Fatal(resp.StatusCode)
	}
	// The signature binds operation, path and user.
	q.Set("signature", files.Sign("s.txt", "write", "", "tok", nil))
	resp, b = get(q, nil)
	wantJSONError(t, resp, b, 401)
	q = url.Values{"path": {"s.txt"}, "username": {e.user}}
	q.Set("signature", files.Sign("s.txt", "read", "", "tok", nil))
	resp, b = get(q, nil)
	wantJSONError(t, resp, b, 401)
	q.Set("signature", files.Sign("s.txt", "read", e.user, "tok", nil))
	if resp, _ := get(q, nil); resp.StatusCode != 200 {
		t.Fatal(resp.StatusCode)
	}
	// Expiration: valid in the future, refused in the past or when tampered.
	future := time.Now().Add(time.Minute).Unix()
	q = url.Values{"path": {"s.txt"}, "signature": {files.Sign("s.txt", "read", "", "tok", &future)}, "signature_expiration": {strconv.FormatInt(future, 10)}}
	if resp, _ := get(q, nil); resp.StatusCode != 200 {
		t.Fatal(resp.StatusCode)
	}
	q.Set("signature_expiration", strconv.FormatInt(future+1, 10))
	resp, b = get(q, nil)
	wantJSONError(t, resp, b, 401)
	past := time.Now().Add(-time.Minute).Unix()
	q = url.Values{"path": {"s.txt"}, "signature": {files.Sign("s.txt", "read", "", "tok", &past)}, "signature_expiration": {strconv.FormatInt(past, 10)}}
	resp, b = get(q, nil)
	wantJSONError(t, resp, b, 401)

	// Upload with a write signature.
	ct, body := multipartBody(t, map[string]string{"u.txt": "up"}, []string{"u.txt"}, "file")
	q = url.Values{"path": {"u.txt"}, "signature": {files.Sign("u.txt", "write", "", "tok", nil)}}
	resp, b = e.do("POST", "/files?"+q.Encode(), body, map[string]string{"Content-Type": ct})
	if resp.StatusCode != 200 {
		t.Fatalf("%d %s", resp.StatusCode, b)
	}
	ct, body = multipartBody(t, map[string]string{"u.txt": "up"}, []string{"u.txt"}, "file")
	resp, b = e.do("POST", "/files?path=u.txt", body, map[string]string{"Content-Type": ct})
	wantJSONError(t, resp, b, 401)
}

// X-Metadata-* headers become user xattrs, reported back in the upload response and EntryInfo.
func TestFilesMetadata(t *testing.T) {
	e := newEnv(t, envOpts{})
	resp, b := e.do("POST", "/files?path=m.txt", strings.NewReader("meta"), map[string]string{
		"Content-Type": "application/octet-stream", "X-Metadata-Owner": "me", "x-metadata-build.id": "42"})
	if resp.StatusCode == 400 && strings.Contains(string(b), "does not support") {
		t.Skip("no user xattrs on this filesystem")
	}
	var written []files.WrittenFile
	if resp.StatusCode != 200 || json.Unmarshal(b, &written) != nil || len(written) != 1 ||
		written[0].Metadata["owner"] != "me" || written[0].Metadata["build.id"] != "42" {
		t.Fatalf("%d %s", resp.StatusCode, b)
	}
	st, err := e.fs.Stat(t.Context(), connect.NewRequest(&fspb.StatRequest{Path: "m.txt"}))
	if err != nil || st.Msg.Entry.Metadata["owner"] != "me" {
		t.Fatalf("stat metadata: %v %v", st, err)
	}
	// Stored in E2B's xattr namespace; other user.* attributes are not metadata.
	p := filepath.Join(e.home, "m.txt")
	v := make([]byte, 16)
	if n, err := unix.Getxattr(p, "user.e2b.owner", v); err != nil || string(v[:n]) != "me" {
		t.Fatalf("user.e2b.owner: %v", err)
	}
	if err := unix.Setxattr(p, "user.other", []byte("tool"), 0); err != nil {
		t.Fatal(err)
	}
	if md := filesystem.ReadMetadata(p); len(md) != 2 {
		t.Fatalf("metadata %v: want owner and build.id only", md)
	}
	// Writing again replaces the metadata: without headers, none is left (and other
	// attributes stay).
	resp, b = e.do("POST", "/files?path=m.txt", strings.NewReader("again"), map[string]string{
		"Content-Type": "application/octet-stream", "X-Metadata-Owner": "you"})
	if resp.StatusCode != 200 {
		t.Fatalf("%d %s", resp.StatusCode, b)
	}
	if md := filesystem.ReadMetadata(p); len(md) != 1 || md["owner"] != "you" {
		t.Fatalf("metadata after a rewrite with owner=you: %v", md)
	}
	resp, b = e.do("POST", "/files?path=m.txt", strings.NewReader("plain"), map[string]string{
		"Content-Type": "application/octet-stream"})
	if resp.StatusCode != 200 {
		t.Fatalf("%d %s", resp.StatusCode, b)
	}
	st, err = e.fs.Stat(t.Context(), connect.NewRequest(&fspb.StatRequest{Path: "m.txt"}))
	if err != nil || len(st.Msg.Entry.Metadata) != 0 {
		t.Fatalf("metadata after a rewrite without any: %v %v", st, err)
	}
	if _, err := unix.Getxattr(p, "user.other", make([]byte, 16)); err != nil {
		t.Fatalf("a rewrite removed another tool's attribute: %v", err)
	}
	resp, b = e.do("POST", "/files?path=m2.txt", strings.NewReader("x"), map[string]string{
		"Content-Type": "application/octet-stream", "X-Metadata-Bad": "a\tb"})
	wantJSONError(t, resp, b, 400)
}
