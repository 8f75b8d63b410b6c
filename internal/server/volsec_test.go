package server

import (
	"context"
	"net/http"
	"strings"
	"testing"

	"github.com/aenv-dev/aenv/internal/secret"
	"github.com/aenv-dev/aenv/internal/volume"
)

const otherKey = "e2b_fedcba9876543210fedcba9876543210fedcba98"

// twoKeys accepts testKey and otherKey: two owners.
type twoKeys struct{}

func (twoKeys) Authenticate(_ context.Context, key string) (bool, error) {
	return key == testKey || key == otherKey, nil
}

func newVolSecEnv(t *testing.T) (*env, *volume.Store, *secret.Store) {
	t.Helper()
	vs, err := volume.Open(t.TempDir(), volume.Options{})
	if err != nil {
		t.Fatal(err)
	}
	ss, err := secret.Open(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	e := newEnv(t, func(o *Options) { o.Auth, o.Volumes, o.Secrets, o.NodeName = twoKeys{}, vs, ss, "node-a" })
	return e, vs, ss
}

func TestVolumeAPI(t *testing.T) {
	e, _, _ := newVolSecEnv(t)
	rec := e.do("POST", "/volumes", `{"name":"data"}`)
	if rec.Code != http.StatusCreated {
		t.Fatalf("create: %d %s", rec.Code, rec.Body)
	}
	vol := decode[struct{ VolumeID, Name, Token string }](t, rec)
	if vol.Name != "data" || vol.Token == "" || !strings.HasPrefix(vol.VolumeID, "vol_") {
		t.Fatalf("created %+v", vol)
	}
	wantError(t, e.do("POST", "/volumes", `{"name":"data"}`), http.StatusConflict, "exists")
	wantError(t, e.do("POST", "/volumes", `{"name":"../x"}`), http.StatusBadRequest, "volume name")
	wantError(t, e.do("GET", "/volumes/vol_00000000000000000000", ""), http.StatusNotFound, "not found")
	// Another API key neither sees nor deletes it.
	other := map[string]string{"X-API-Key": otherKey}
	if rec := e.doWith("GET", "/volumes", "", other); rec.Body.String() != "[]\n" {
		t.Fatalf("other key lists %s", rec.Body)
	}
	wantError(t, e.doWith("DELETE", "/volumes/"+vol.VolumeID, "", other), http.StatusNotFound, "not found")

	// Content API: Bearer token of the volume.
	bearer := map[string]string{"Authorization": "Bearer " + vol.Token}
	req := func(method, path, body string, hdr map[string]string) (int, string) {
		r := e.doWith(method, path, body, hdr)
		return r.Code, r.Body.String()
	}
	if code, body := req("PUT", "/volumecontent/"+vol.VolumeID+"/file?path=/d/hello.txt", "hello", bearer); code != 200 || !strings.Contains(body, `"size":5`) {
		t.Fatalf("write: %d %s", code, body)
	}
	if code, body := req("GET", "/volumecontent/"+vol.VolumeID+"/file?path=/d/hello.txt", "", bearer); code != 200 || body != "hello" {
		t.Fatalf("read: %d %q", code, body)
	}
	if code, body := req("GET", "/volumecontent/"+vol.VolumeID+"/dir?path=/&depth=2", "", bearer); code != 200 || !strings.Contains(body, `"path":"/d/hello.txt"`) {
		t.Fatalf("list: %d %s", code, body)
	}
	if code, _ := req("GET", "/volumecontent/"+vol.VolumeID+"/path?path=/nope", "", bearer); code != 404 {
		t.Fatalf("stat missing: %d", code)
	}
	if code, _ := req("GET", "/volumecontent/"+vol.VolumeID+"/file?path=/d/hello.txt", "", map[string]string{"Authorization": "Bearer nope"}); code != 401 {
		t.Fatalf("bad token: %d", code)
	}
	if code, _ := req("GET", "/volumecontent/"+vol.VolumeID+"/file?path=/d/hello.txt", "", nil); code != 401 {
		t.Fatalf("no token: %d", code)
	}

	// Mounting: unknown volumes and bad paths are refused before the orchestrator is asked.
	wantError(t, e.do("POST", "/v2/sandboxes", `{"templateID":"base","volumeMounts":[{"name":"nope","path":"/mnt/x"}]}`), http.StatusBadRequest, `volume "nope" not found on node "node-a": volumes are node-local`)
	wantError(t, e.do("POST", "/v2/sandboxes", `{"templateID":"base","volumeMounts":[{"name":"data","path":"/proc/x"}]}`), http.StatusBadRequest, "/proc")
	wantError(t, e.do("POST", "/v2/sandboxes", `{"templateID":"base","volumeMounts":[{"name":"data","path":"rel"}]}`), http.StatusBadRequest, "absolute")
	if n := len(e.orch.sandboxes); n != 0 {
		t.Fatalf("bad mounts started %d sandboxes", n)
	}
	rec = e.do("POST", "/v2/sandboxes", `{"templateID":"base","volumeMounts":[{"name":"data","path":"/mnt/data"}]}`)
	if rec.Code != http.StatusCreated {
		t.Fatalf("create with volume: %d %s", rec.Code, rec.Body)
	}
	sbID := decode[struct{ SandboxID string }](t, rec).SandboxID
	if got := e.orch.lastReq.VolumeMounts; len(got) != 1 || got[0].VolumeID != vol.VolumeID || got[0].Path != "/mnt/data" {
		t.Fatalf("orchestrator got mounts %+v", got)
	}
	if rec := e.do("GET", "/sandboxes/"+sbID, ""); !strings.Contains(rec.Body.String(), `"volumeMounts":[{"name":"data","path":"/mnt/data"}]`) {
		t.Fatalf("detail: %s", rec.Body)
	}
	wantError(t, e.do("DELETE", "/volumes/"+vol.VolumeID, ""), http.StatusConflict, sbID)
	if rec := e.do("DELETE", "/sandboxes/"+sbID, ""); rec.Code != http.StatusNoContent {
		t.Fatalf("kill: %d", rec.Code)
	}
	if rec := e.do("DELETE", "/volumes/"+vol.VolumeID, ""); rec.Code != http.StatusNoContent {
		t.Fatalf("delete: %d %s", rec.Code, rec.Body)
	}
	wantError(t, e.do("GET", "/volumes/data", ""), http.StatusNotFound, "not found")
}

func TestSecretAPI(t *testing.T) {
	e, _, ss := newVolSecEnv(t)
	const value = "sk-live-very-secret-0123456789"
	var bodies []string
	check := func(_ any, body string) { bodies = append(bodies, body) }
	rec := e.do("POST", "/secrets", `{"name":"API-Key","value":"`+value+`","metadata":{"env":"prod"}}`)
	check(rec, rec.Body.String())
	if rec.Code != http.StatusCreated {
		t.Fatalf("create: %d %s", rec.Code, rec.Body)
	}
	s := decode[struct {
		SecretID       string
		Name           string
		CurrentVersion int64
		Metadata       map[string]string
	}](t, rec)
	if s.Name != "api-key" || s.CurrentVersion != 1 || s.Metadata["env"] != "prod" {
		t.Fatalf("created %+v", s)
	}
	for _, r := range []struct{ method, path, body string }{
		{"GET", "/secrets", ""},
		{"GET", "/secrets/" + s.SecretID, ""},
		{"GET", "/secrets/api-key", ""},
		{"POST", "/secrets/api-key", `{"value":"` + value + `2"}`},
	} {
		rec := e.do(r.method, r.path, r.body)
		if rec.Code != http.StatusOK {
			t.Fatalf("%s %s: %d %s", r.method, r.path, rec.Code, rec.Body)
		}
		check(rec, rec.Body.String())
	}
	wantError(t, e.do("POST", "/secrets", `{"name":"api-key","value":"x"}`), http.StatusConflict, "exists")
	wantError(t, e.do("POST", "/secrets", `{"name":"big","value":"`+strings.Repeat("x", secret.MaxValueBytes+1)+`"}`), http.StatusBadRequest, "limit")
	wantError(t, e.do("POST", "/secrets", `{"name":"sec_x","value":"x"}`), http.StatusBadRequest, "reserved")
	wantError(t, e.doWith("GET", "/secrets/api-key", "", map[string]string{"X-API-Key": otherKey}), http.StatusNotFound, "not found")

	// Placeholders: an unknown secret is a 400 before anything starts; a known one reaches
	// the orchestrator unexpanded (it is expanded only for envd).
	wantError(t, e.do("POST", "/v2/sandboxes", `{"templateID":"base","envVars":{"K":"${e2b.secrets.nope}"}}`), http.StatusBadRequest, "nope")
	rec = e.do("POST", "/v2/sandboxes", `{"templateID":"base","envVars":{"K":"Bearer ${e2b.secrets.api-key}"}}`)
	if rec.Code != http.StatusCreated {
		t.Fatalf("create with secret: %d %s", rec.Code, rec.Body)
	}
	check(rec, rec.Body.String())
	if got := e.orch.lastReq.EnvVars["K"]; got != "Bearer ${e2b.secrets.api-key}" {
		t.Fatalf("orchestrator got %q", got)
	}
	sbID := decode[struct{ SandboxID string }](t, rec).SandboxID
	rec = e.do("GET", "/sandboxes/"+sbID, "")
	check(rec, rec.Body.String())
	for _, b := range bodies {
		if strings.Contains(b, value) {
			t.Fatalf("a response carries the secret value: %s", b)
		}
	}
	if v, err := ss.Expand(OwnerOf(testKey), "${e2b.secrets.api-key}"); err != nil || v != value+"2" {
		t.Fatalf("stored value %q %v", v, err)
	}
	if rec := e.do("DELETE", "/secrets/api-key", ""); rec.Code != http.StatusNoContent {
		t.Fatalf("delete: %d", rec.Code)
	}
	wantError(t, e.do("DELETE", "/secrets/api-key", ""), http.StatusNotFound, "not found")
}
