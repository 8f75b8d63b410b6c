package config

import (
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"
)

func envFrom(m map[string]string) func(string) (string, bool) {
	return func(k string) (string, bool) { v, ok := m[k]; return v, ok }
}

func writeFile(t *testing.T, body string) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "aenv.toml")
	if err := os.WriteFile(p, []byte(body), 0o600); err != nil {
		t.Fatal(err)
	}
	return p
}

func TestDefaultsAreSingleNodeLoopback(t *testing.T) {
	c, err := Load("", nil)
	if err != nil {
		t.Fatal(err)
	}
	if c.Listen != "127.0.0.1:8000" || c.DataDir != "/var/lib/aenv" {
		t.Fatalf("listen/data_dir = %q/%q", c.Listen, c.DataDir)
	}
	if c.Sandbox.DefaultTimeout.Duration != 300*time.Second || c.Sandbox.DefaultTimeoutV1.Duration != 15*time.Second {
		t.Fatalf("timeouts = %v/%v", c.Sandbox.DefaultTimeout, c.Sandbox.DefaultTimeoutV1)
	}
	if c.Envd.Version != "0.5.15" || c.Backend.Runtime != "auto" || len(c.Proxy.Domains) != 0 {
		t.Fatalf("unexpected defaults: %+v", c)
	}
}

func TestLoadOverrides(t *testing.T) {
	file := writeFile(t, `
listen = "0.0.0.0:9000"
data_dir = "/srv/aenv"
[sandbox]
default_timeout = "10m"
max_sandboxes = 7
[proxy]
domains = ["sbx.example.com"]
`)
	tests := []struct {
		name  string
		path  string
		env   map[string]string
		check func(t *testing.T, c Config)
	}{
		{"file", file, nil, func(t *testing.T, c Config) {
			if c.Listen != "0.0.0.0:9000" || c.DataDir != "/srv/aenv" || c.Sandbox.MaxSandboxes != 7 {
				t.Fatalf("file not applied: %+v", c)
			}
			if c.Sandbox.DefaultTimeout.Duration != 10*time.Minute {
				t.Fatalf("default_timeout = %v", c.Sandbox.DefaultTimeout)
			}
			if c.Sandbox.DefaultCPU != 2 {
				t.Fatalf("unset key lost its default: default_cpu = %d", c.Sandbox.DefaultCPU)
			}
		}},
		{"env beats file", file, map[string]string{
			"AENV_LISTEN": "127.0.0.1:8123", "AENV_SANDBOX_MAX_SANDBOXES": "3",
			"AENV_SANDBOX_DEFAULT_TIMEOUT": "90s", "AENV_PROXY_DOMAINS": "a.test, b.test",
			"AENV_API_KEY": "e2b_0123456789abcdef0123",
		}, func(t *testing.T, c Config) {
			if c.Listen != "127.0.0.1:8123" || c.Sandbox.MaxSandboxes != 3 || c.Sandbox.DefaultTimeout.Duration != 90*time.Second {
				t.Fatalf("env not applied: %+v", c)
			}
			if !slices.Equal(c.Proxy.Domains, []string{"a.test", "b.test"}) {
				t.Fatalf("domains = %q", c.Proxy.Domains)
			}
			if c.APIKey != "e2b_0123456789abcdef0123" {
				t.Fatalf("AENV_API_KEY not applied: %q", c.APIKey)
			}
		}},
		{"env without file", "", map[string]string{"AENV_ENVD_PATH": "/opt/envd", "AENV_BACKEND_RUNTIME": "runc"},
			func(t *testing.T, c Config) {
				if c.Envd.Path != "/opt/envd" || c.Backend.Runtime != "runc" {
					t.Fatalf("env not applied: %+v", c)
				}
			}},
		{"runtime path", "", map[string]string{"AENV_BACKEND_RUNTIME": "/opt/crun-1.19/crun"},
			func(t *testing.T, c Config) {
				if c.Backend.Runtime != "/opt/crun-1.19/crun" {
					t.Fatalf("runtime = %q", c.Backend.Runtime)
				}
			}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c, err := Load(tt.path, envFrom(tt.env))
			if err != nil {
				t.Fatal(err)
			}
			tt.check(t, c)
		})
	}
}

func TestLoadErrorsNameTheKey(t *testing.T) {
	tests := []struct {
		name, file string
		env        map[string]string
		want       string
	}{
		{"unknown key", "lisen = \"x:1\"\n", nil, "unknown keys: lisen"},
		{"unknown section key", "[sandbox]\ndefault_timout = \"1s\"\n", nil, "sandbox.default_timout"},
		{"bad duration in file", "[sandbox]\ndefault_timeout = \"soon\"\n", nil, "duration"},
		{"bad listen", "listen = \"8000\"\n", nil, "listen"},
		{"bad debug listen", "", map[string]string{"AENV_DEBUG_LISTEN": "6060"}, "debug_listen"},
		{"bad metrics listen", "metrics_listen = \"9100\"\n", nil, "metrics_listen"},
		{"bad env int", "", map[string]string{"AENV_SANDBOX_DEFAULT_CPU": "two"}, "AENV_SANDBOX_DEFAULT_CPU"},
		{"bad env duration", "", map[string]string{"AENV_ENVD_READY_TIMEOUT": "-"}, "AENV_ENVD_READY_TIMEOUT"},
		{"bad runtime", "", map[string]string{"AENV_BACKEND_RUNTIME": "docker"}, "backend.runtime"},
		{"relative runtime path", "", map[string]string{"AENV_BACKEND_RUNTIME": "bin/crun"}, "backend.runtime"},
		{"bad backend kind", "", map[string]string{"AENV_BACKEND_KIND": "lxc"}, "backend.kind"},
		{"microvm without layered base", "[backend]\nkind = \"microvm\"\n[templates]\nlayered_base = false\n", nil, "templates.layered_base"},
		{"bad accel", "", map[string]string{"AENV_BACKEND_ACCEL": "hvf"}, "backend.accel"},
		{"negative tb size", "", map[string]string{"AENV_BACKEND_TB_SIZE_MIB": "-1"}, "backend.tb_size_mib"},
		{"huge tb size", "[backend]\ntb_size_mib = 5000\n", nil, "backend.tb_size_mib"},
		{"negative snapshot pool", "", map[string]string{"AENV_BACKEND_SNAPSHOT_POOL": "-1"}, "backend.snapshot_pool"},
		{"negative warm containers", "", map[string]string{"AENV_BACKEND_WARM_CONTAINERS": "-1"}, "backend.warm_containers"},
		{"warm max below warm", "[backend]\nwarm_containers = 8\nwarm_containers_max = 4\n", nil, "backend.warm_containers_max"},
		{"huge snapshot pool max", "[backend]\nsnapshot_pool_max = 5000\n", nil, "backend.snapshot_pool_max"},
		{"negative uid ranges", "", map[string]string{"AENV_BACKEND_UID_RANGES": "-1"}, "backend.uid_ranges"},
		{"huge uid ranges", "[backend]\nuid_ranges = 70000\n", nil, "backend.uid_ranges"},
		{"bad shutdown action", "[sandbox]\nshutdown_action = \"explode\"\n", nil, "sandbox.shutdown_action"},
		{"bad envd version", "", map[string]string{"AENV_ENVD_VERSION": "latest"}, "envd.version"},
		{"short api key", "", map[string]string{"AENV_API_KEY": "short"}, "api_key"},
		{"default above max", "[sandbox]\ndefault_timeout = \"48h\"\n", nil, "exceeds sandbox.max_timeout"},
		{"bad snapshot quiesce in file", "[snapshot]\nquiesce = \"fsfreeze\"\n", nil, "snapshot.quiesce"},
		{"bad snapshot quiesce env", "", map[string]string{"AENV_SNAPSHOT_QUIESCE": "none"}, "snapshot.quiesce"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			path := ""
			if tt.file != "" {
				path = writeFile(t, tt.file)
			}
			_, err := Load(path, envFrom(tt.env))
			if err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Fatalf("err = %v, want it to mention %q", err, tt.want)
			}
		})
	}
}

func TestMissingFileIsAnError(t *testing.T) {
	if _, err := Load(filepath.Join(t.TempDir(), "nope.toml"), nil); err == nil {
		t.Fatal("want an error for a missing config file")
	}
}

func TestRelativeDataDirBecomesAbsolute(t *testing.T) {
	c, err := Load("", envFrom(map[string]string{"AENV_DATA_DIR": "rel/dir"}))
	if err != nil {
		t.Fatal(err)
	}
	if !filepath.IsAbs(c.DataDir) || !strings.HasSuffix(c.DataDir, "rel/dir") {
		t.Fatalf("data_dir = %q", c.DataDir)
	}
}

func TestEnvVarsCoverEveryKey(t *testing.T) {
	vars := EnvVars()
	for _, want := range []string{"AENV_LISTEN", "AENV_DATA_DIR", "AENV_API_KEY", "AENV_SANDBOX_DEFAULT_TIMEOUT",
		"AENV_ENVD_PATH", "AENV_TEMPLATES_BASE_ROOTFS", "AENV_PROXY_DOMAINS"} {
		if !slices.Contains(vars, want) {
			t.Errorf("EnvVars() lacks %s", want)
		}
	}
	// Every variable EnvVars names must be honoured by Load.
	for _, v := range vars {
		if _, err := Load("", envFrom(map[string]string{v: "\x00invalid"})); err == nil && v != "AENV_DATA_DIR" {
			// Strings accept anything; only typed keys must fail. Check it at least applies.
			c, _ := Load("", envFrom(map[string]string{v: "zzz-marker"}))
			if !strings.Contains(strings.ReplaceAll(fmtConfig(c), "\n", " "), "zzz-marker") {
				t.Errorf("%s is not applied by Load", v)
			}
		}
	}
}

func fmtConfig(c Config) string {
	return strings.Join([]string{c.Listen, c.DataDir, c.APIKey, c.MetricsToken, c.LogLevel, c.LogFormat, c.Envd.Path, c.Envd.Version,
		c.Backend.Kind, c.Backend.Runtime, c.Backend.CgroupParent, c.Backend.GuestKernel, c.Backend.GuestInitrd, c.Backend.QEMUUser, c.Network.Bridge, c.Network.Subnet, c.Network.Prefix, c.Network.EgressUpstreamCA, c.Templates.BaseRootFS, c.Templates.BaseMirror, c.Templates.BaseSuite, c.Sandbox.ShutdownAction, strings.Join(c.Proxy.Domains, ",")}, " ")
}

// TestDocumented keeps docs/configuration.md in step with the settings.
func TestDocumented(t *testing.T) {
	doc, err := os.ReadFile("../../docs/configuration.md")
	if err != nil {
		t.Skipf("docs not available: %v", err)
	}
	for _, v := range EnvVars() {
		// A setting's row names its variable once; two rows drift apart (one of them
		// kept saying sandbox.shutdown_action=keep dropped layered sandboxes).
		row := regexp.MustCompile("(?m)^\\| `[a-z_.]+` \\| `" + v + "` \\|")
		switch n := len(row.FindAllIndex(doc, -1)); {
		case n == 0 && !strings.Contains(string(doc), "`"+v+"`"):
			t.Errorf("docs/configuration.md does not document %s", v)
		case n > 1:
			t.Errorf("docs/configuration.md documents %s in %d rows of its table, want one", v, n)
		}
	}
}

// FuzzLoad: any file content either loads into a valid config or fails with an error.
func FuzzLoad(f *testing.F) {
	f.Add(DefaultTOML())
	f.Add("listen = \"x\"\n[sandbox]\nmax_sandboxes = -1\n")
	f.Add("[proxy]\ndomains = [1, 2]\n")
	f.Fuzz(func(t *testing.T, body string) {
		p := filepath.Join(t.TempDir(), "c.toml")
		if err := os.WriteFile(p, []byte(body), 0o600); err != nil {
			t.Fatal(err)
		}
		c, err := Load(p, nil)
		if err == nil {
			if verr := c.Validate(); verr != nil {
				t.Fatalf("Load accepted an invalid config: %v", verr)
			}
		}
	})
}
