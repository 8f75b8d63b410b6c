package integration

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/google/go-containerregistry/pkg/registry"

	"github.com/aenv-dev/aenv/internal/bench"
	"github.com/aenv-dev/aenv/test/debian"
)

// TestDebianImages: images as they are published (a debootstrap minbase root: usr-merged,
// glibc, no `user` account) pulled converted (layered, the default where the base is
// layered) and unconverted run sandboxes whose default user is `user` (uid 1000, home
// /home/user owned by it) or the image's USER; commands run as that user and as root,
// and files are written and read through envd as both.
func TestDebianImages(t *testing.T) {
	n := newNode(t)
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Minute)
	defer cancel()
	repo, err := repoRoot()
	if err != nil {
		t.Fatal(err)
	}
	root, err := debian.Root(ctx, repo)
	if errors.Is(err, debian.ErrUnavailable) {
		t.Skip(err)
	}
	if err != nil {
		t.Fatal(err)
	}
	imgs, err := debian.Images(root)
	if err != nil {
		t.Fatal(err)
	}
	reg := httptest.NewServer(registry.New(registry.Logger(log.New(io.Discard, "", 0))))
	defer reg.Close()
	refs, err := debian.Push(strings.TrimPrefix(reg.URL, "http://"), imgs)
	if err != nil {
		t.Fatal(err)
	}
	n.start()
	c := n.client()
	for _, tc := range []struct {
		name, image string
		convert     bool
		user, uid   string
		home        string
	}{
		{"converted", debian.Plain, true, "user", "1000", "/home/user"},
		{"unconverted", debian.Plain, false, "user", "1000", "/home/user"},
		{"image USER", debian.WithUser, true, "app", fmt.Sprint(debian.AppUID), "/home/app"},
		{"image USER a bare uid", debian.BareUID, true, "user", "1000", "/home/user"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			name := strings.NewReplacer(" ", "-").Replace("deb-" + tc.name)
			pullTemplate(ctx, t, n, refs[tc.image], name, tc.convert)
			sb, err := c.Create(ctx, bench.CreateRequest{TemplateID: name, Timeout: 300, Secure: true})
			if err != nil {
				t.Fatalf("create from %s: %v", tc.image, err)
			}
			n.observe()
			defer c.Kill(context.WithoutCancel(ctx), sb.ID)
			// A converted template's sandboxes run on a root on its layers (an overlay over
			// them, shared, or with backend.overlay_roots off an ext4 block root), which
			// snapshots; the others on an overlay of the directory, which cannot.
			snap, serr := c.Snapshot(ctx, sb.ID)
			if (serr == nil) != tc.convert {
				t.Errorf("snapshot: %v, converted %v", serr, tc.convert)
			}
			if serr == nil {
				if err := c.DeleteTemplate(ctx, snap); err != nil {
					t.Errorf("delete snapshot %s: %v", snap, err)
				}
			}
			want := strings.Join([]string{tc.user, tc.uid, tc.home, tc.user}, "\n")
			if got := run(ctx, t, c, sb, `id -un; id -u; echo $HOME; stat -c %U ~`); got != want {
				t.Errorf("default user: got %q, want %q", got, want)
			}
			if got := run(ctx, t, c, sb, `touch ~/made && cat /etc/debian_version >/dev/null && readlink /bin && echo ok`); got != "usr/bin\nok" {
				t.Errorf("as the default user: %q", got)
			}
			if got := runAs(ctx, t, c, sb, "root", `id -u; touch /root/made && echo ok`); got != "0\nok" {
				t.Errorf("as root: %q", got)
			}
			if got := runAs(ctx, t, c, sb, "user", `id -un; echo $HOME`); got != "user\n/home/user" {
				t.Errorf("as user: %q", got)
			}
			// Files through envd: written as user into its home, read back; root's are root's.
			putFile(ctx, t, n, sb, "user", "/home/user/note.txt", "from the SDK")
			putFile(ctx, t, n, sb, "root", "/root/secret", "root only")
			if got := run(ctx, t, c, sb, `stat -c '%U %s' /home/user/note.txt; cat /root/secret 2>/dev/null || echo denied`); got != "user 12\ndenied" {
				t.Errorf("files: %q", got)
			}
			if got := getFile(ctx, t, n, sb, "user", "/home/user/note.txt"); got != "from the SDK" {
				t.Errorf("read back %q", got)
			}
		})
	}
}

// pullTemplate pulls ref as the template name through the node's pull endpoint.
func pullTemplate(ctx context.Context, t *testing.T, n *node, ref, name string, convert bool) {
	t.Helper()
	body := fmt.Sprintf(`{"ref":%q,"name":%q,"convert":%v}`, ref, name, convert)
	out, err := n.api(ctx, http.MethodPost, "/aenv/templates/pull", body, http.StatusOK)
	if err != nil {
		t.Fatalf("pull %s: %v", ref, err)
	}
	var last struct {
		Template *struct {
			TemplateID string `json:"templateID"`
		} `json:"template"`
		Error *struct {
			Message string `json:"message"`
		} `json:"error"`
	}
	sc := bufio.NewScanner(bytes.NewReader(out))
	for sc.Scan() {
		if err := json.Unmarshal(sc.Bytes(), &last); err != nil {
			t.Fatalf("pull event %q: %v", sc.Text(), err)
		}
	}
	if last.Error != nil || last.Template == nil {
		t.Fatalf("pull %s: %s", ref, out)
	}
}

func runAs(ctx context.Context, t *testing.T, c *bench.Client, sb bench.Sandbox, user, cmdline string) string {
	t.Helper()
	res, err := c.RunAs(ctx, sb, user, cmdline)
	if err != nil || res.ExitCode != 0 {
		t.Fatalf("run %q as %s: %v (exit %d) %s%s", cmdline, user, err, res.ExitCode, res.Stdout, res.Stderr)
	}
	return strings.TrimSpace(res.Stdout)
}

// envdFiles calls envd's /files through the node's proxy.
func envdFiles(ctx context.Context, n *node, sb bench.Sandbox, method, user, path string, body io.Reader) (*http.Response, error) {
	req, err := http.NewRequestWithContext(ctx, method, n.url()+"/files?path="+url.QueryEscape(path)+"&username="+user, body)
	if err != nil {
		return nil, err
	}
	req.Header.Set("E2b-Sandbox-Id", sb.ID)
	req.Header.Set("E2b-Sandbox-Port", "49983")
	req.Header.Set("X-Access-Token", sb.Token)
	req.Header.Set("Content-Type", "application/octet-stream")
	return http.DefaultClient.Do(req)
}

func putFile(ctx context.Context, t *testing.T, n *node, sb bench.Sandbox, user, path, content string) {
	t.Helper()
	resp, err := envdFiles(ctx, n, sb, http.MethodPost, user, path, strings.NewReader(content))
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("write %s as %s: %d %s", path, user, resp.StatusCode, b)
	}
}

func getFile(ctx context.Context, t *testing.T, n *node, sb bench.Sandbox, user, path string) string {
	t.Helper()
	resp, err := envdFiles(ctx, n, sb, http.MethodGet, user, path, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("read %s as %s: %d %s", path, user, resp.StatusCode, b)
	}
	return string(b)
}
