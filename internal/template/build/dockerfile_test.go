package build

import (
	"errors"
	"reflect"
	"strings"
	"testing"
)

func TestParseDockerfile(t *testing.T) {
	tests := []struct {
		name  string
		in    string
		args  map[string]string
		from  string
		steps []Step
		start string
		ready string
		check func(t *testing.T, d *Dockerfile)
	}{
		{
			name: "basic",
			in: `# comment
FROM busybox:1.36
RUN echo hi && \
    echo there
ENV A=1 B="two words"
WORKDIR /app
USER user
COPY --chown=user:user --chmod=755 a.txt b/ /app/
CMD ["./serve", "--port", "80"]
`,
			from: "busybox:1.36",
			steps: []Step{
				{Type: StepRun, Args: []string{"echo hi &&  echo there"}},
				{Type: StepEnv, Args: []string{"A", "1", "B", "two words"}},
				{Type: StepWorkdir, Args: []string{"/app"}},
				{Type: StepUser, Args: []string{"user"}},
				{Type: StepCopy, Args: []string{"a.txt", "/app/", "user:user", "0755"}},
				{Type: StepCopy, Args: []string{"b", "/app/", "user:user", "0755"}},
			},
			start: "./serve --port 80",
		},
		{
			name: "args and substitution",
			in: `ARG BASE=alpine
ARG TAG
FROM ${BASE}:${TAG:-3.19}
ARG VERSION=1.0
ENV V=$VERSION HOME_DIR=/home/${NAME:-user}
WORKDIR $HOME_DIR/src
RUN make V=$VERSION
`,
			args: map[string]string{"VERSION": "2.5"},
			from: "alpine:3.19",
			steps: []Step{
				{Type: StepEnv, Args: []string{"V", "2.5", "HOME_DIR", "/home/user"}},
				{Type: StepWorkdir, Args: []string{"/home/user/src"}},
				{Type: StepRun, Args: []string{"export VERSION=2.5; make V=$VERSION"}},
			},
		},
		{
			name:  "legacy env, exec run, entrypoint plus cmd, healthcheck",
			in:    "FROM debian\nENV GREETING hello world\nRUN [\"apt-get\", \"install\", \"-y\", \"x y\"]\nENTRYPOINT [\"/bin/app\"]\nCMD [\"--v\"]\nHEALTHCHECK --interval=5s CMD curl -f localhost:80\n",
			from:  "debian",
			steps: []Step{{Type: StepEnv, Args: []string{"GREETING", "hello world"}}, {Type: StepRun, Args: []string{"apt-get install -y 'x y'"}}},
			start: "/bin/app --v",
			ready: "curl -f localhost:80",
			check: func(t *testing.T, d *Dockerfile) {
				// Not honoured, so said: the ready command is polled, not on an interval.
				if len(d.Warnings) != 1 || !strings.Contains(d.Warnings[0], "line 6: HEALTHCHECK --interval=5s has no effect") {
					t.Errorf("warnings %q", d.Warnings)
				}
			},
		},
		{
			name:  "shell entrypoint ignores cmd; later ENTRYPOINT resets CMD",
			in:    "FROM x\nCMD [\"a\"]\nENTRYPOINT node server.js\n",
			from:  "x",
			start: "node server.js",
		},
		{
			name: "expose, label, volume warning, ADD local file, escaped dollar",
			in:   "FROM x\nEXPOSE 80 443/tcp\nLABEL a=b \"c d\"=e\nVOLUME /data\nADD conf.txt /etc/conf.txt\nRUN echo \\$HOME\n",
			from: "x",
			steps: []Step{
				{Type: StepCopy, Args: []string{"conf.txt", "/etc/conf.txt", "root", ""}},
				{Type: StepRun, Args: []string{`echo \$HOME`}},
			},
			check: func(t *testing.T, d *Dockerfile) {
				if !reflect.DeepEqual(d.Expose, []string{"80", "443/tcp"}) || d.Labels["a"] != "b" || d.Labels["c d"] != "e" {
					t.Errorf("expose %v labels %v", d.Expose, d.Labels)
				}
				if len(d.Warnings) != 1 || !strings.Contains(d.Warnings[0], "VOLUME") {
					t.Errorf("warnings %v", d.Warnings)
				}
			},
		},
		{
			name: "ADD of a local tar archive extracts it; other files are copied",
			in:   "FROM x\nADD app.tar.gz /opt/app/\nADD notes.txt /opt/\n",
			from: "x",
			steps: []Step{
				{Type: StepCopy, Args: []string{"app.tar.gz", "/tmp/.aenv-add-0/", "root", ""}},
				{Type: StepRun, Args: []string{"mkdir -p /opt/app/ && tar -xf /tmp/.aenv-add-0/app.tar.gz -C /opt/app/ && rm -rf /tmp/.aenv-add-0", "root"}},
				{Type: StepCopy, Args: []string{"notes.txt", "/opt/", "root", ""}},
			},
		},
		{
			name:  "FROM AS and platform, lowercase instructions",
			in:    "from --platform=linux/amd64 ubuntu:22.04 as build\nrun true\n",
			from:  "ubuntu:22.04",
			steps: []Step{{Type: StepRun, Args: []string{"true"}}},
			check: func(t *testing.T, d *Dockerfile) {
				if len(d.Warnings) != 1 || !strings.Contains(d.Warnings[0], "--platform=linux/amd64 has no effect") {
					t.Errorf("warnings %q", d.Warnings)
				}
			},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			d, err := ParseDockerfile(strings.NewReader(tt.in), tt.args)
			if err != nil {
				t.Fatal(err)
			}
			if d.From != tt.from {
				t.Errorf("from = %q, want %q", d.From, tt.from)
			}
			if len(d.Steps) != 0 || len(tt.steps) != 0 {
				if !reflect.DeepEqual(d.Steps, tt.steps) {
					t.Errorf("steps:\n got %+v\nwant %+v", d.Steps, tt.steps)
				}
			}
			if d.StartCmd != tt.start || d.ReadyCmd != tt.ready {
				t.Errorf("start %q ready %q, want %q %q", d.StartCmd, d.ReadyCmd, tt.start, tt.ready)
			}
			if tt.check != nil {
				tt.check(t, d)
			}
		})
	}
}

func TestParseDockerfileErrors(t *testing.T) {
	tests := []struct{ name, in, want string }{
		{"empty", "", "no FROM"},
		{"run before from", "RUN x\nFROM y", "before FROM"},
		{"multi-stage", "FROM a AS b\nFROM c\n", "multi-stage"},
		{"copy from", "FROM a\nCOPY --from=b /x /y\n", "--from"},
		{"copy parents", "FROM a\nCOPY --parents a/b/c /y/\n", "--parents is not supported"},
		{"copy exclude", "FROM a\nCOPY --exclude=*.md . /y/\n", "--exclude is not supported"},
		{"add checksum", "FROM a\nADD --checksum=sha256:00 x.tar /y/\n", "--checksum is not supported"},
		{"add url", "FROM a\nADD https://x/y.tgz /y\n", "URL"},
		{"heredoc", "FROM a\nRUN <<EOF\necho\nEOF\n", "heredoc"},
		{"run mount", "FROM a\nRUN --mount=type=cache,target=/c make\n", "--mount"},
		{"shell", "FROM a\nSHELL [\"/bin/zsh\"]\n", "SHELL"},
		{"escape context", "FROM a\nCOPY ../secret /x\n", "leaves the build context"},
		{"bad port", "FROM a\nEXPOSE http\n", "not a port"},
		{"bad user", "FROM a\nUSER a b\n", "not a user"},
		{"unknown", "FROM a\nFROBNICATE\n", "unknown instruction"},
		{"scratch", "FROM scratch\n", "shell"},
		{"unterminated", "FROM a\nENV A=\"x\n", "unterminated"},
		{"bad substitution", "FROM a\nWORKDIR ${A?x}\n", "bad variable"},
		{"copy needs dest", "FROM a\nCOPY a\n", "destination"},
		{"escape directive", "# escape=`\nFROM a\n", "escape="},
		{"nul byte", "FROM a\nRUN x\x00\n", "NUL"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := ParseDockerfile(strings.NewReader(tt.in), nil)
			if err == nil || !errors.Is(err, ErrDockerfile) || !strings.Contains(err.Error(), tt.want) {
				t.Fatalf("err = %v, want ErrDockerfile containing %q", err, tt.want)
			}
		})
	}
}

func TestDockerfileSpec(t *testing.T) {
	d, err := ParseDockerfile(strings.NewReader("FROM a\nRUN x\nCMD sleep 1\n"), nil)
	if err != nil {
		t.Fatal(err)
	}
	s := d.Spec()
	want := []Step{{Type: StepUser, Args: []string{"root"}}, {Type: StepRun, Args: []string{"x"}}, {Type: StepDefaultUser}}
	if s.FromImage != "a" || s.StartCmd != "sleep 1" || !reflect.DeepEqual(s.Steps, want) {
		t.Errorf("spec = %+v", s)
	}
	d.SetsUser = true
	if s := d.Spec(); s.Steps[len(s.Steps)-1].Type != StepRun {
		t.Errorf("a Dockerfile with USER must keep its last user: %+v", s.Steps)
	}
	// EXPOSE and LABEL become steps that record them (labels in key order).
	d, err = ParseDockerfile(strings.NewReader("FROM a\nEXPOSE 80 53/udp\nLABEL z=1 a=2\nUSER x\n"), nil)
	if err != nil {
		t.Fatal(err)
	}
	want = []Step{{Type: StepUser, Args: []string{"root"}}, {Type: StepUser, Args: []string{"x"}},
		{Type: StepExpose, Args: []string{"80", "53/udp"}}, {Type: StepLabel, Args: []string{"a", "2", "z", "1"}}}
	if s := d.Spec(); !reflect.DeepEqual(s.Steps, want) || s.Validate() != nil {
		t.Errorf("spec steps = %+v (%v)", s.Steps, s.Validate())
	}
}

func FuzzParseDockerfile(f *testing.F) {
	for _, s := range []string{
		"FROM a\nRUN echo hi\n",
		"ARG X=1\nFROM b:${X}\nENV A=$X B \"c\"\nCOPY --chown=u:g x y /z/\nCMD [\"a\"]\n",
		"FROM a\nHEALTHCHECK CMD [\"true\"]\nENTRYPOINT [\"x\"]\nLABEL a=\"b\\\"c\"\n",
		"FROM a \\\n  AS b\nWORKDIR ${A:+/x}\nUSER 1000:1000\nEXPOSE 80/udp\n",
	} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, in string) {
		d, err := ParseDockerfile(strings.NewReader(in), map[string]string{"X": "y"})
		if err != nil {
			if !errors.Is(err, ErrDockerfile) {
				t.Fatalf("error does not wrap ErrDockerfile: %v", err)
			}
			return
		}
		if d.From == "" {
			t.Fatal("parsed without a FROM")
		}
		// Whatever parses must make a spec the server accepts (COPY aside: it needs uploads).
		s := d.Spec()
		for i := range s.Steps {
			if s.Steps[i].Type == StepCopy {
				s.Steps[i].FilesHash = "abc"
			}
		}
		if err := s.Validate(); err != nil {
			t.Fatalf("parsed Dockerfile makes an invalid spec: %v\n%q", err, in)
		}
	})
}

// TestDescribeStepNeverBlank: every step the build log shows has its value, including
// the DEFAULT_USER step a Dockerfile without USER ends with.
func TestDescribeStepNeverBlank(t *testing.T) {
	x := &executor{startUser: "user"}
	for _, tt := range []struct {
		st   Step
		want string
	}{
		{Step{Type: StepDefaultUser}, "USER user (the template's default user)"},
		{Step{Type: StepUser, Args: []string{"app"}}, "USER 'app'"},
		{Step{Type: StepWorkdir, Args: []string{"/srv app"}}, "WORKDIR '/srv app'"},
		{Step{Type: StepRun, Args: []string{"make", "root"}}, "RUN make (as root)"},
		{Step{Type: StepEnv, Args: []string{"A", "", "B", "2"}}, "ENV A B"},
		{Step{Type: StepExpose, Args: []string{"80"}}, "EXPOSE 80"},
	} {
		got := x.describeStep(tt.st)
		if got != tt.want || strings.HasSuffix(got, " ") {
			t.Errorf("describeStep(%+v) = %q, want %q", tt.st, got, tt.want)
		}
	}
}
