package integration

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/google/go-containerregistry/pkg/registry"

	"github.com/aenv-dev/aenv/internal/config"
	"github.com/aenv-dev/aenv/test/debian"
)

// docBlock is one fenced code block of README.md or docs/*.md.
type docBlock struct {
	file string // base name
	line int    // of the opening fence
	lang string
	cmds []docCmd
}

// docCmd is one command line of a block (continuation lines joined).
type docCmd struct {
	line int
	text string
}

func (c docCmd) where(b docBlock) string { return fmt.Sprintf("%s:%d", b.file, c.line) }

// readDocBlocks returns the fenced blocks of README.md and docs/*.md, in file order.
func readDocBlocks(t *testing.T, repo string) []docBlock {
	t.Helper()
	files, err := filepath.Glob(filepath.Join(repo, "docs", "*.md"))
	if err != nil {
		t.Fatal(err)
	}
	files = append([]string{filepath.Join(repo, "README.md")}, files...)
	var blocks []docBlock
	for _, f := range files {
		raw, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		var cur *docBlock
		cont := ""
		contLine := 0
		for i, line := range strings.Split(string(raw), "\n") {
			trim := strings.TrimSpace(line)
			if strings.HasPrefix(trim, "```") {
				if cur == nil {
					cur = &docBlock{file: filepath.Base(f), line: i + 1, lang: strings.TrimPrefix(trim, "```")}
				} else {
					blocks = append(blocks, *cur)
					cur = nil
				}
				continue
			}
			if cur == nil || trim == "" {
				continue
			}
			if cont == "" {
				contLine = i + 1
			}
			if strings.HasSuffix(trim, `\`) {
				cont += strings.TrimSuffix(trim, `\`) + " "
				continue
			}
			cur.cmds = append(cur.cmds, docCmd{line: contLine, text: cont + trim})
			cont = ""
		}
		if cur != nil {
			t.Fatalf("%s:%d: a fenced block that never closes", filepath.Base(f), cur.line)
		}
	}
	return blocks
}

// Languages of fenced blocks. Shell blocks are run (or listed below); TOML blocks are
// node configurations and must load; the rest show code for other tools or output.
var (
	shellLangs = map[string]bool{"sh": true, "bash": true, "shell": true, "": true}
	otherLangs = map[string]string{
		"text": "output or a listing, not a command",
		"json": "a document for another tool (e.g. an S3 bucket lifecycle rule)",
		"js":   "SDK code, run by test/e2e/docs.test.mjs",
		"toml": "a node configuration: loaded by config.Load in this test",
	}
)

// notRun lists the shell examples this test does not run, each with the reason and where
// the same thing is tested instead. An entry names the file and the example's text as the
// docs show it; block entries stand for the whole block their first command opens. An entry
// that no longer matches an example fails the test, so the list stays true.
var notRun = []struct {
	file, text string
	block      bool
	why        string
}{
	{"README.md", "make serve   # installs what is missing, builds, and runs `aenv serve` on 127.0.0.1:8000", false,
		"runs a node in the foreground on port 8000; this test starts the node as its last step does (aenv serve --data-dir --envd --base-rootfs)"},
	{"README.md", "make test    # installs what is missing, builds, runs unit, integration, race-detector and SDK e2e tests", false,
		"runs this test (and every other one)"},
	{"getting-started.md", "make serve", false, "as README.md's make serve"},
	{"cluster.md", "aenv scheduler --listen 10.0.0.5:9090", false,
		"a daemon on a cluster host; TestNodeJoinsCluster and TestClusterNetns run `aenv scheduler --listen`"},
	{"cluster.md", "AENV_API_KEY=$KEY aenv serve --scheduler 10.0.0.5:9090 --listen 10.0.0.11:8000   # on every node", false,
		"a daemon on each node host; TestNodeJoinsCluster runs nodes with AENV_API_KEY and --scheduler"},
	{"cluster.md", "AENV_API_KEY=$KEY aenv gateway --scheduler 10.0.0.5:9090 --listen 0.0.0.0:8080", false,
		"a daemon; TestClusterNetns runs `aenv gateway --listen --scheduler` with AENV_API_KEY"},
	{"cluster.md", "E2B_API_URL=http://gateway:8080 E2B_SANDBOX_URL=http://gateway:8080 E2B_API_KEY=$KEY python agent.py", false,
		"the reader's own agent; test/e2e/cluster.test.mjs drives the SDK through a gateway"},
	{"cluster.md", "cd deploy/k8s/base && kustomize edit set image aenv=registry.example.com/aenv:v1 && cd -", true,
		"needs kustomize and the reader's registry; deploy/k8s TestRender renders the kustomizations"},
	{"cluster.md", "kubectl apply -f deploy/k8s/base/namespace.yaml", true,
		"needs a Kubernetes cluster; deploy/k8s TestApplyDryRun applies the manifests to a real kube-apiserver"},
	{"cluster.md", "kubectl label node worker-1 worker-2 aenv.dev/node=true", true,
		"needs a Kubernetes cluster with nodes; deploy/k8s TestApplyDryRun applies deploy/k8s/base"},
	{"cluster.md", "kubectl -n aenv-system port-forward svc/aenv-gateway 8080:80 &", true,
		"needs a deployed cluster; `aenv nodes --url` is run by TestNodeJoinsCluster against a scheduler's gateway"},
	{"cluster.md", "aenv nodes drain NODE --url http://gateway:8080      # POST /nodes/NODE/drain at the gateway", true,
		"needs a cluster (scheduler, gateway, two nodes); TestDrainNode runs `aenv nodes drain` and `undrain` through a gateway"},
	{"cluster.md", "AENV_CLUSTER_P2P_ENABLED=true AENV_CLUSTER_P2P_LISTEN=10.0.0.11:7070 AENV_CLUSTER_P2P_TOKEN=$PEER_SECRET  aenv serve --scheduler 10.0.0.5:9090 --listen 10.0.0.11:8000", false,
		"a daemon on each node host of a cluster; TestClusterNetns runs nodes with these settings"},
	{"configuration.md", "aenv serve --config /etc/aenv/config.toml", false,
		"a daemon on 0.0.0.0:8000; this test loads the TOML block above it with config.Load"},
	{"configuration.md", "AENV_SANDBOX_MAX_SANDBOXES=50 aenv serve --config /etc/aenv/config.toml   # env beats the file", false,
		"a daemon; this test loads the same file with AENV_SANDBOX_MAX_SANDBOXES=50 and checks that it wins"},
}

// follows lists the examples that run until interrupted (aenv logs -f): they are run for
// 5 s and must still be running then.
var follows = []struct{ file, text string }{
	{"getting-started.md", "aenv logs $ID -f --since 10m --level warn   # follow new entries; -o table|json"},
}

// TestDocsExamples runs every shell example of README.md and docs/*.md against a node
// started here, as a reader would type them: each file's examples in order in one shell
// (variables a block sets, such as ID=$(aenv start -d), carry to the next lines), stdin
// empty (an attached shell ends at once), in a fresh working directory holding data.csv
// (the file the upload example copies). The node stands in for `make serve`'s: it generates
// its admin key into its data directory, and the CLI finds both through AENV_URL and
// AENV_DATA_DIR. Placeholders the docs use for the reader's own values are replaced:
//
//	/var/lib/aenv, http://127.0.0.1:8000, http://node:8000   the node's data dir and URL
//	e2b_...                                                the node's admin key
//	python:3.12-slim                                       a Debian image on a local registry
//	                                                       (no Docker Hub here)
//
// Examples that cannot run here are listed in notRun with the reason; a new example is run
// unless listed, and a block in a language this test does not know fails it.
func TestDocsExamples(t *testing.T) {
	repo, err := repoRoot()
	if err != nil {
		t.Fatal(err)
	}
	blocks := readDocBlocks(t, repo)
	shell := docShellScripts(t, blocks)
	checkDocTOML(t, blocks)

	n := newNode(t, "AENV_API_KEY=") // as make serve: the node generates its admin key
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	deb, err := debian.Root(ctx, repo)
	if errors.Is(err, debian.ErrUnavailable) {
		t.Skip(err)
	}
	if err != nil {
		t.Fatal(err)
	}
	imgs, err := debian.Images(deb)
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
	key, err := os.ReadFile(filepath.Join(n.dataDir, "admin.key"))
	if err != nil {
		t.Fatalf("the node generated no admin key: %v", err)
	}
	n.key = strings.TrimSpace(string(key))
	subst := strings.NewReplacer(
		"/var/lib/aenv", n.dataDir,
		"http://127.0.0.1:8000", n.url(),
		"http://node:8000", n.url(),
		"e2b_...", n.key,
		"python:3.12-slim", refs[debian.Plain],
	)
	for _, s := range shell {
		t.Run(s.file, func(t *testing.T) {
			runDocScript(ctx, t, n, subst.Replace(s.script))
		})
	}
}

// docScript is one file's runnable examples as one bash script.
type docScript struct{ file, script string }

// docShellScripts classifies every block, checks the lists against the docs, and returns
// the scripts to run.
func docShellScripts(t *testing.T, blocks []docBlock) []docScript {
	t.Helper()
	usedSkip := make([]bool, len(notRun))
	usedFollow := make([]bool, len(follows))
	var out []docScript
	for _, b := range blocks {
		if !shellLangs[b.lang] {
			if _, ok := otherLangs[b.lang]; !ok {
				t.Errorf("%s:%d: a ```%s block: run it here, or classify the language in otherLangs", b.file, b.line, b.lang)
			}
			continue
		}
		if len(out) == 0 || out[len(out)-1].file != b.file {
			out = append(out, docScript{file: b.file})
		}
		var sb strings.Builder
	cmds:
		for i, c := range b.cmds {
			for k, s := range notRun {
				if s.file == b.file && s.text == c.text && (!s.block || i == 0) {
					usedSkip[k] = true
					if s.block {
						break cmds
					}
					continue cmds
				}
			}
			prefix := ""
			for k, f := range follows {
				if f.file == b.file && f.text == c.text {
					usedFollow[k], prefix = true, "follow "
				}
			}
			fmt.Fprintf(&sb, "where=%s\nprintf '%%s\\n' %s >&2\n%s%s\n", sq(c.where(b)), sq("$ "+c.where(b)+": "+c.text), prefix, c.text)
		}
		out[len(out)-1].script += sb.String()
	}
	for k, s := range notRun {
		if !usedSkip[k] {
			t.Errorf("notRun lists %s %q, which no longer is an example there", s.file, s.text)
		}
	}
	for k, f := range follows {
		if !usedFollow[k] {
			t.Errorf("follows lists %s %q, which no longer is an example there", f.file, f.text)
		}
	}
	// Files whose every example is listed have nothing to run.
	kept := out[:0]
	for _, s := range out {
		if s.script != "" {
			kept = append(kept, s)
		}
	}
	if len(kept) == 0 {
		t.Fatal("no shell examples found to run")
	}
	return kept
}

// sq quotes s for the shell, as it is.
func sq(s string) string { return "'" + strings.ReplaceAll(s, "'", `'\''`) + "'" }

// docScriptPrelude stops a script at the first failing example and names it.
const docScriptPrelude = `set -eo pipefail
where=start
trap 'echo "aenv-docs: exit status $? at $where" >&2' ERR
follow() {
	local rc=0
	timeout 5 "$@" || rc=$?
	if [ "$rc" != 124 ]; then echo "aenv-docs: $1 ended (exit status $rc) instead of following" >&2; return 1; fi
}
`

// runDocScript runs one file's examples in a fresh working directory and HOME.
func runDocScript(ctx context.Context, t *testing.T, n *node, script string) {
	t.Helper()
	dir := t.TempDir()
	home := filepath.Join(dir, "home")
	work := filepath.Join(dir, "work")
	for _, d := range []string{home, work} {
		if err := os.Mkdir(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.WriteFile(filepath.Join(work, "data.csv"), []byte("b,2\na,1\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(dir, "examples.sh")
	if err := os.WriteFile(path, []byte(docScriptPrelude+script), 0o644); err != nil {
		t.Fatal(err)
	}
	cmd := exec.CommandContext(ctx, "bash", path)
	cmd.Dir = work
	env := []string{}
	for _, kv := range os.Environ() {
		k, _, _ := strings.Cut(kv, "=")
		if strings.HasPrefix(k, "AENV_") || strings.HasPrefix(k, "E2B_") || k == "HOME" || k == "XDG_CONFIG_HOME" || k == "PATH" {
			continue
		}
		env = append(env, kv)
	}
	cmd.Env = append(env, "HOME="+home, "PATH="+filepath.Dir(n.bins.aenv)+":"+os.Getenv("PATH"),
		"AENV_URL="+n.url(), "AENV_DATA_DIR="+n.dataDir)
	cmd.Stdin = nil // /dev/null: an attached shell reads EOF and ends
	cmd.WaitDelay = 5 * time.Second
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("the examples failed (%v):\n%s", err, out)
	}
	t.Logf("ran:\n%s", out)
}

// checkDocTOML loads every TOML block of docs/configuration.md with config.Load, as
// `aenv serve --config` does, alone and under AENV_SANDBOX_MAX_SANDBOXES=50, which must win.
func checkDocTOML(t *testing.T, blocks []docBlock) {
	t.Helper()
	found := 0
	for _, b := range blocks {
		if b.lang != "toml" {
			continue
		}
		found++
		var body strings.Builder
		for _, c := range b.cmds {
			body.WriteString(c.text + "\n")
		}
		p := filepath.Join(t.TempDir(), "config.toml")
		if err := os.WriteFile(p, []byte(body.String()), 0o600); err != nil {
			t.Fatal(err)
		}
		c, err := config.Load(p, func(string) (string, bool) { return "", false })
		if err == nil {
			err = c.Validate()
		}
		if err != nil {
			t.Errorf("%s:%d: the TOML example does not load: %v", b.file, b.line, err)
			continue
		}
		env := func(k string) (string, bool) {
			if k == "AENV_SANDBOX_MAX_SANDBOXES" {
				return "50", true
			}
			return "", false
		}
		if c2, err := config.Load(p, env); err != nil || c2.Sandbox.MaxSandboxes != 50 {
			t.Errorf("%s:%d: AENV_SANDBOX_MAX_SANDBOXES=50 over the file: %v, max_sandboxes %d", b.file, b.line, err, c2.Sandbox.MaxSandboxes)
		}
	}
	if found == 0 {
		t.Error("no TOML example found (docs/configuration.md shows one)")
	}
}
