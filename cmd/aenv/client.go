package main

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/BurntSushi/toml"

	"github.com/aenv-dev/aenv/internal/apikey"
	"github.com/aenv-dev/aenv/internal/config"
	"github.com/aenv-dev/aenv/internal/server/api"
)

const defaultURL = "http://127.0.0.1:8000"

// credentials is the file `aenv login` writes (TOML, mode 0600).
type credentials struct {
	URL    string `toml:"url"`
	APIKey string `toml:"api_key"`
}

// credentialsPath is $XDG_CONFIG_HOME/aenv/credentials.toml (~/.config/aenv/...).
func credentialsPath() (string, error) {
	dir, err := os.UserConfigDir()
	if err != nil {
		return "", fmt.Errorf("find the config directory: %w", err)
	}
	return filepath.Join(dir, "aenv", "credentials.toml"), nil
}

func readCredentials() (credentials, error) {
	var c credentials
	p, err := credentialsPath()
	if err != nil {
		return c, err
	}
	if _, err := toml.DecodeFile(p, &c); err != nil && !errors.Is(err, os.ErrNotExist) {
		return c, fmt.Errorf("read %s: %w (run `aenv login` again)", p, err)
	}
	return c, nil
}

// client talks to one aenv node: the REST API and, through the node's proxy, envd.
type client struct {
	base string
	key  string
	http *http.Client
	api  *api.ClientWithResponses
}

// resolve picks the node URL and key: flags, then AENV_URL/AENV_API_KEY, then the login
// file, then (key only) the admin.key of a node on this machine.
func (g *globals) resolve() (string, string, error) {
	creds, err := readCredentials()
	if err != nil {
		return "", "", err
	}
	u := firstNonEmpty(g.url, os.Getenv("AENV_URL"), creds.URL, defaultURL)
	key := firstNonEmpty(g.apiKey, os.Getenv("AENV_API_KEY"), creds.APIKey)
	if key == "" {
		dataDir := firstNonEmpty(g.dataDir, os.Getenv("AENV_DATA_DIR"), config.Default().DataDir)
		if raw, err := os.ReadFile(filepath.Join(dataDir, apikey.AdminKeyFile)); err == nil {
			key = strings.TrimSpace(string(raw))
		}
	}
	if key == "" {
		return "", "", errors.New("no API key: pass --api-key, set AENV_API_KEY, or run `aenv login` " +
			"(a node prints where its admin key is when it starts)")
	}
	pu, err := url.Parse(u)
	if err != nil || (pu.Scheme != "http" && pu.Scheme != "https") || pu.Host == "" {
		return "", "", fmt.Errorf("node URL %q is not an http(s) URL like %s", u, defaultURL)
	}
	return strings.TrimRight(u, "/"), key, nil
}

func (g *globals) client() (*client, error) {
	base, key, err := g.resolve()
	if err != nil {
		return nil, err
	}
	// No overall timeout: exec and shell streams live as long as the command runs. A node
	// that accepts connections but never answers is cut by the response timeout instead.
	connect := cmp.Or(g.connectTimeout, 10*time.Second)
	hc := &http.Client{Transport: &http.Transport{
		Proxy:                 http.ProxyFromEnvironment,
		DialContext:           (&net.Dialer{Timeout: connect}).DialContext,
		TLSHandshakeTimeout:   connect,
		ResponseHeaderTimeout: g.responseTimeout,
		MaxIdleConnsPerHost:   8,
		IdleConnTimeout:       60 * time.Second,
	}}
	c := &client{base: base, key: key, http: hc}
	c.api, err = api.NewClientWithResponses(base, api.WithHTTPClient(hc),
		api.WithRequestEditorFn(func(_ context.Context, req *http.Request) error {
			req.Header.Set("X-API-Key", key)
			return nil
		}))
	if err != nil {
		return nil, err
	}
	return c, nil
}

// transportErr explains a request that got no answer.
func (c *client) transportErr(err error) error {
	if errors.Is(err, context.Canceled) {
		return err
	}
	if strings.Contains(err.Error(), "timeout awaiting response headers") {
		return fmt.Errorf("the aenv node at %s accepted the request but did not answer in time: %w (raise --response-timeout for slow operations)", c.base, err)
	}
	return fmt.Errorf("cannot reach the aenv node at %s: %w (is `aenv serve` running? set --url or AENV_URL)", c.base, err)
}

// apiErr turns a non-2xx answer into an error that says what to do.
func (c *client) apiErr(what string, status int, body []byte) error {
	var e api.Error
	msg := strings.TrimSpace(string(body))
	if json.Unmarshal(body, &e) == nil && e.Message != "" {
		msg = e.Message
	}
	hint := ""
	switch status {
	case http.StatusUnauthorized:
		hint = " (check --api-key / AENV_API_KEY, or run `aenv login`)"
	case http.StatusNotFound:
		hint = " (" + listingFor(what) + ")"
	case http.StatusServiceUnavailable:
		hint = " (the node is at capacity; kill or pause sandboxes, or raise sandbox.max_sandboxes)"
	}
	return fmt.Errorf("%s: %s (HTTP %d)%s", what, msg, status, hint)
}

// listingFor names the command that lists what a failed request (described by what, e.g.
// "delete template X") was about, for a 404's hint.
func listingFor(what string) string {
	w := strings.ToLower(what)
	switch {
	case strings.Contains(w, "snapshot"):
		return "`aenv snapshot ls` lists snapshots"
	case strings.Contains(w, "template"), strings.HasPrefix(w, "pull "), strings.Contains(w, "build"):
		return "`aenv template ls` lists templates"
	case strings.Contains(w, "key"), strings.HasPrefix(w, "revoke "):
		return "`aenv keys list` lists API keys"
	}
	return "`aenv ls` lists sandboxes"
}

func firstNonEmpty(vals ...string) string {
	for _, v := range vals {
		if v != "" {
			return v
		}
	}
	return ""
}

// sandboxInfo fetches a sandbox's details, including its envd access token.
func (c *client) sandboxInfo(ctx context.Context, id string) (*api.SandboxDetail, error) {
	resp, err := c.api.GetSandboxWithResponse(ctx, id)
	if err != nil {
		return nil, c.transportErr(err)
	}
	if resp.JSON200 == nil {
		return nil, c.apiErr("sandbox "+id, resp.StatusCode(), resp.Body)
	}
	return resp.JSON200, nil
}

// allPages follows X-Next-Token until the server has no more items. fetch makes one
// request with the given token (nil for the first page) and returns the decoded page
// (nil on a non-2xx answer), the response and its body.
func allPages[T any](c *client, what string, fetch func(next *string) (*[]T, *http.Response, []byte, error)) ([]T, error) {
	all := []T{}
	var next *string
	for {
		page, resp, body, err := fetch(next)
		if err != nil {
			return nil, c.transportErr(err)
		}
		if page == nil {
			return nil, c.apiErr(what, resp.StatusCode, body)
		}
		all = append(all, *page...)
		tok := resp.Header.Get("X-Next-Token")
		if tok == "" {
			return all, nil
		}
		next = &tok
	}
}

// encodeIndented writes v as indented JSON, the CLI's output when piped.
func encodeIndented(w io.Writer, v any) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(v)
}
