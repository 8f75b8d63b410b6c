package envd_test

import (
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/aenv-dev/aenv/internal/envd"
	"github.com/aenv-dev/aenv/internal/envd/identity"
	"github.com/aenv-dev/aenv/internal/envd/state"
)

func fuzzServer(f *testing.F) (*envd.Server, string) {
	dir := f.TempDir()
	home := dir + "/home"
	_ = mkdir(home)
	pw := dir + "/passwd"
	_ = writeFile(pw, "root:x:0:0:root:"+home+":/bin/sh\n")
	srv := envd.New(envd.Config{Users: identity.DB{PasswdPath: pw, GroupPath: dir + "/group"}, Defaults: state.New("root"), DiskPath: dir})
	f.Cleanup(srv.Close)
	return srv, home
}

// Connect envelopes and JSON bodies from the network never crash envd and always get a Connect
// answer: 200 with an end-of-stream (streams) or a JSON error.
func FuzzConnectEnvelope(f *testing.F) {
	srv, _ := fuzzServer(f)
	f.Add([]byte("\x00\x00\x00\x00\x1b{\"process\":{\"pid\":4000000}}"), true)
	f.Add([]byte("\x00\x00\x00\x00\x1c{\"process\":{\"tag\":\"nothing\"}}"), true)
	f.Add([]byte("\x02\x00\x00\x00\x02{}"), true)
	f.Add([]byte("\x01\x00\x00\x00\x02{}"), true)
	f.Add([]byte("\x00\xff\xff\xff\xff"), true)
	f.Add([]byte("\x00\x00\x00\x00\x05{\"pro"), true)
	f.Add([]byte("{\"path\":\"/nonexistent\"}"), false)
	f.Add([]byte("{\"path\":123}"), false)
	f.Add([]byte("{\"path\":\"\\u0000\"}"), false)
	f.Add([]byte("not json"), false)
	f.Fuzz(func(t *testing.T, body []byte, stream bool) {
		path, ct := "/filesystem.Filesystem/Stat", "application/json"
		if stream {
			path, ct = "/process.Process/Connect", "application/connect+json"
		}
		req := httptest.NewRequest(http.MethodPost, path, strings.NewReader(string(body)))
		req.Header.Set("Content-Type", ct)
		req.Header.Set("Connect-Protocol-Version", "1")
		rec := httptest.NewRecorder()
		srv.ServeHTTP(rec, req)
		if rec.Code >= 500 && rec.Code != 501 && rec.Code != 503 && rec.Code != 504 {
			// connect-go maps internal/unknown errors to 500; ours never come from bad input.
			if !strings.Contains(rec.Body.String(), `"code"`) {
				t.Fatalf("status %d body %q", rec.Code, rec.Body.String())
			}
		}
		if stream && rec.Code == 200 && rec.Body.Len() < 5 {
			t.Fatalf("stream without end-of-stream: %q", rec.Body.String())
		}
	})
}

// Upload bodies (multipart or raw, optionally claiming gzip) never crash envd and get a JSON
// answer. The target is pinned with ?path so that fuzzed file names cannot reach other paths.
func FuzzUpload(f *testing.F) {
	srv, _ := fuzzServer(f)
	f.Add("multipart/form-data; boundary=b", "", []byte("--b\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a/b.txt\"\r\n\r\nhello\r\n--b--\r\n"))
	f.Add("multipart/form-data; boundary=b", "", []byte("--b\r\nContent-Disposition: form-data; name=file; filename=ünï.txt\r\n\r\nx\r\n--b--\r\n"))
	f.Add("multipart/form-data; boundary=b", "", []byte("--b\r\nContent-Disposition: form-data; name=\"file\"; filename*=UTF-8''%e2%82%ac.txt\r\n\r\nx\r\n--b--\r\n"))
	f.Add("multipart/form-data; boundary=b", "", []byte("--b\r\nContent-Disposition: form-data; name=\"file\"\r\n\r\ntrunc"))
	f.Add("multipart/form-data", "", []byte("--b--"))
	f.Add("application/octet-stream", "gzip", []byte("\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\xff"))
	f.Add("application/octet-stream", "", []byte("raw"))
	f.Add("text/plain; charset", "br", []byte(""))
	f.Fuzz(func(t *testing.T, ct, enc string, body []byte) {
		req := httptest.NewRequest(http.MethodPost, "/files?path=fuzz/out.bin", strings.NewReader(string(body)))
		req.Header.Set("Content-Type", ct)
		if enc != "" {
			req.Header.Set("Content-Encoding", enc)
		}
		rec := httptest.NewRecorder()
		srv.ServeHTTP(rec, req)
		if !strings.HasPrefix(rec.Header().Get("Content-Type"), "application/json") {
			t.Fatalf("status %d, content type %q", rec.Code, rec.Header().Get("Content-Type"))
		}
		if rec.Code != 200 && rec.Code != 400 && rec.Code != 507 {
			t.Fatalf("status %d: %s", rec.Code, rec.Body.String())
		}
	})
}
