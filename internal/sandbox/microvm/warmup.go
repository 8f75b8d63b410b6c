package microvm

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"mime/multipart"
	"net/http"
	"net/url"
	"time"

	"connectrpc.com/connect"

	"github.com/aenv-dev/aenv/internal/envd/gen/filesystem"
	"github.com/aenv-dev/aenv/internal/envd/gen/filesystem/filesystemconnect"
	"github.com/aenv-dev/aenv/internal/envdclient"
)

// Under TCG a guest path runs slowly the first time: QEMU translates its code, and the
// translation cache belongs to the QEMU process. A VM restored from a snapshot starts
// with an empty cache, so its first command took 1.3–2.9 s (envd's /init, its Connect
// JSON codec, the process start, bash's login start-up), against ~50 ms for the second.
// A pooled VM is therefore driven, before it is stopped, through the requests a
// sandbox's first minute makes with the E2B SDKs: /init, a file written, read, stat'ed
// and removed, and `/bin/bash -l -c` as the default user over Connect JSON (and once more
// in binary protobuf, which Go clients use). Nothing of it stays visible: /init sets the
// values the guest already holds, the file is removed, the processes have ended, and the
// access token is the one the snapshot's envd held.

// warmupPrefix names the file the warm-up writes and removes in the guest's /tmp.
const warmupPrefix = "/tmp/.aenv-warmup-"

// warm waits until the guest's envd answers /health, then runs the warm-up. token is the
// access token the guest's envd holds ("" for none, or unknown). Only envd's answer is
// required and the other steps are best effort (a token the pool does not know makes
// envd refuse them, a template without bash cannot run the command; the first command
// after hand-out pays their translation instead), except that a file the warm-up wrote
// and could not remove makes the VM unfit: warm fails and the VM is stopped.
func warm(ctx context.Context, inst *Instance, token string) error {
	if err := warmHealth(ctx, inst); err != nil {
		return err
	}
	cctx, cancel := context.WithTimeout(ctx, poolWarmTimeout/2)
	defer cancel()
	t0 := time.Now()
	ep := inst.Endpoint()
	w := warmer{base: fmt.Sprintf("http://%s:%d", ep.Host, ep.EnvdPort), token: token, hc: http.DefaultClient}
	err := w.init(cctx)
	if err == nil {
		var left bool
		left, err = w.file(cctx, warmupPrefix+inst.id)
		if left {
			return fmt.Errorf("microvm: pool: warm-up file left in the guest: %w", err)
		}
	}
	if err == nil {
		err = w.command(cctx, true, "echo ok")
	}
	if err == nil {
		err = w.command(cctx, false, "true")
	}
	if err != nil {
		inst.b.log.Debug("microvm: pool: warm-up incomplete", "vm", inst.id, "err", err)
		return nil
	}
	inst.b.vmpool.warmed.Add(1)
	inst.b.log.Debug("microvm: pool: warmed", "vm", inst.id, "took", time.Since(t0))
	return nil
}

func warmHealth(ctx context.Context, inst *Instance) error {
	ep := inst.Endpoint()
	url := fmt.Sprintf("http://%s:%d/health", ep.Host, ep.EnvdPort)
	c := http.Client{Timeout: time.Second}
	for answers := 0; answers < 2; {
		req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
		if err != nil {
			return err
		}
		resp, err := c.Do(req)
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode < 300 {
				answers++
				continue
			}
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("microvm: pool: envd of a restored VM did not answer: %w", ctx.Err())
		case <-time.After(5 * time.Millisecond):
		}
	}
	return nil
}

// warmer sends the warm-up's requests to one guest's envd.
type warmer struct {
	base  string
	token string
	hc    *http.Client
}

// do sends one plain HTTP request with the token and returns the body of a 2xx answer.
func (w warmer) do(ctx context.Context, method, path string, ct string, body []byte) ([]byte, error) {
	req, err := http.NewRequestWithContext(ctx, method, w.base+path, bytes.NewReader(body))
	if err != nil {
		return nil, err
	}
	if ct != "" {
		req.Header.Set("Content-Type", ct)
	}
	if w.token != "" {
		req.Header.Set("X-Access-Token", w.token)
	}
	resp, err := w.hc.Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	raw, err := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
	if err != nil {
		return nil, err
	}
	if resp.StatusCode/100 != 2 {
		return nil, fmt.Errorf("%s %s: status %d: %s", method, path, resp.StatusCode, bytes.TrimSpace(raw))
	}
	return raw, nil
}

// init posts an /init that changes nothing: the environment the guest's envd holds, with
// the same values (the orchestrator's /init at hand-out then sets the sandbox's own),
// without a token (the held one stays), a default user or workdir, or a timestamp (a
// timestamp would become the last one applied, and an /init with an older one is
// ignored: the hand-out's must never be).
func (w warmer) init(ctx context.Context) error {
	raw, err := w.do(ctx, http.MethodGet, "/envs", "", nil)
	if err != nil {
		return err
	}
	env := map[string]string{}
	if err := json.Unmarshal(raw, &env); err != nil {
		return fmt.Errorf("envs: %w", err)
	}
	body, err := json.Marshal(map[string]any{"envVars": env})
	if err != nil {
		return err
	}
	_, err = w.do(ctx, http.MethodPost, "/init", "application/json", body)
	return err
}

// file writes a small file at path as the default user (multipart, as the SDKs upload),
// reads it back, stats and removes it over the filesystem service in Connect JSON. left
// reports that the file may still be there.
func (w warmer) file(ctx context.Context, path string) (left bool, err error) {
	var buf bytes.Buffer
	mw := multipart.NewWriter(&buf)
	part, err := mw.CreateFormFile("file", "warmup")
	if err != nil {
		return false, err
	}
	if _, err := part.Write([]byte("warm-up\n")); err != nil {
		return false, err
	}
	if err := mw.Close(); err != nil {
		return false, err
	}
	c := envdclient.New(w.hc, w.base, envdclient.WithAccessToken(w.token), envdclient.WithJSON())
	fs := filesystemconnect.NewFilesystemClient(w.hc, w.base, c.ClientOptions()...)
	// Whatever happens after the upload was sent, the file is removed.
	defer func() {
		_, rerr := fs.Remove(context.WithoutCancel(ctx), connect.NewRequest(&filesystem.RemoveRequest{Path: path}))
		if rerr != nil && connect.CodeOf(rerr) != connect.CodeNotFound {
			left, err = true, errors.Join(err, fmt.Errorf("remove %s: %w", path, rerr))
		}
	}()
	q := "/files?path=" + url.QueryEscape(path)
	if _, err := w.do(ctx, http.MethodPost, q, mw.FormDataContentType(), buf.Bytes()); err != nil {
		return false, err
	}
	if _, err := w.do(ctx, http.MethodGet, q, "", nil); err != nil {
		return false, err
	}
	_, err = fs.Stat(ctx, connect.NewRequest(&filesystem.StatRequest{Path: path}))
	return false, err
}

// command runs script with `/bin/bash -l -c` as the default user, the way the SDKs'
// commands.run does, in Connect JSON or binary protobuf, and waits for its end.
func (w warmer) command(ctx context.Context, jsonCodec bool, script string) error {
	opts := []envdclient.Option{envdclient.WithAccessToken(w.token)}
	if jsonCodec {
		opts = append(opts, envdclient.WithJSON())
	}
	c := envdclient.New(w.hc, w.base, opts...)
	p, err := c.Start(ctx, envdclient.Command{Cmd: "/bin/bash", Args: []string{"-l", "-c", script}})
	if err != nil {
		return err
	}
	defer p.Close()
	end, err := p.Wait(io.Discard, io.Discard)
	if err != nil {
		return err
	}
	if end.GetExitCode() != 0 {
		return fmt.Errorf("warm-up command %q exited %d", script, end.GetExitCode())
	}
	return nil
}
