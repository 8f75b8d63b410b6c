package build

import (
	"bufio"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"maps"
	"path"
	"regexp"
	"slices"
	"strconv"
	"strings"

	"github.com/aenv-dev/aenv/internal/image"
)

// ErrDockerfile is wrapped by every Dockerfile parse error.
var ErrDockerfile = errors.New("dockerfile")

// escapeDirective is the `# escape=X` parser directive.
var escapeDirective = regexp.MustCompile(`^#\s*escape\s*=\s*(\S+)`)

// maxDockerfile bounds what ParseDockerfile reads; real Dockerfiles are a few KiB.
const maxDockerfile = 1 << 20

// Dockerfile is a parsed single-stage Dockerfile, turned into build steps.
type Dockerfile struct {
	From string
	// Steps are RUN, ENV, WORKDIR, USER and COPY steps in file order. COPY steps have
	// Args [src, dest, owner, mode] with one source each, src relative to the context.
	Steps []Step
	// StartCmd comes from ENTRYPOINT and CMD, ReadyCmd from HEALTHCHECK CMD.
	StartCmd string
	ReadyCmd string
	Expose   []string
	Labels   map[string]string
	// SetsUser reports whether the file has a USER instruction.
	SetsUser bool
	// Warnings name instructions that were accepted but have no effect here.
	Warnings []string
}

type dfLine struct {
	no   int
	text string
}

// ParseDockerfile parses a single-stage Dockerfile. buildArgs override ARG defaults
// (docker build --build-arg). Unsupported features (multi-stage, heredocs, RUN --mount,
// ADD from URLs, COPY --from, SHELL) are errors that name the line.
func ParseDockerfile(r io.Reader, buildArgs map[string]string) (*Dockerfile, error) {
	lines, err := dfLines(io.LimitReader(r, maxDockerfile+1))
	if err != nil {
		return nil, err
	}
	p := &dfParser{df: &Dockerfile{Labels: map[string]string{}}, args: map[string]string{},
		declared: map[string]bool{}, env: map[string]string{}, buildArgs: buildArgs}
	for _, l := range lines {
		if err := p.instruction(l); err != nil {
			return nil, fmt.Errorf("%w: line %d: %w", ErrDockerfile, l.no, err)
		}
	}
	if p.df.From == "" {
		return nil, fmt.Errorf("%w: no FROM instruction", ErrDockerfile)
	}
	p.df.StartCmd = startCommand(p.entrypoint, p.cmd)
	return p.df, nil
}

// dfLines joins continuation lines and drops comments and blank lines.
func dfLines(r io.Reader) ([]dfLine, error) {
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 64<<10), maxDockerfile+1)
	var (
		out   []dfLine
		cur   strings.Builder
		start int
		total int
		no    int
	)
	for sc.Scan() {
		no++
		raw := sc.Text()
		if strings.ContainsRune(raw, 0) {
			return nil, fmt.Errorf("%w: line %d: NUL byte", ErrDockerfile, no)
		}
		total += len(raw) + 1
		if total > maxDockerfile {
			return nil, fmt.Errorf("%w: larger than %d bytes", ErrDockerfile, maxDockerfile)
		}
		trimmed := strings.TrimSpace(raw)
		if strings.HasPrefix(trimmed, "#") {
			// Comments, and parser directives before the first instruction: only the
			// default escape character is supported.
			if m := escapeDirective.FindStringSubmatch(trimmed); m != nil && len(out) == 0 && cur.Len() == 0 && m[1] != `\` {
				return nil, fmt.Errorf("%w: line %d: escape=%s is not supported (only the default backslash)", ErrDockerfile, no, m[1])
			}
			continue
		}
		if cur.Len() == 0 {
			if trimmed == "" {
				continue
			}
			start = no
		}
		if strings.HasSuffix(trimmed, `\`) {
			cur.WriteString(strings.TrimSuffix(trimmed, `\`))
			cur.WriteByte(' ')
			continue
		}
		cur.WriteString(trimmed)
		out = append(out, dfLine{no: start, text: strings.TrimSpace(cur.String())})
		cur.Reset()
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("%w: %w", ErrDockerfile, err)
	}
	if cur.Len() > 0 {
		if t := strings.TrimSpace(cur.String()); t != "" {
			out = append(out, dfLine{no: start, text: t})
		}
	}
	return out, nil
}

type dfParser struct {
	df         *Dockerfile
	args       map[string]string // ARG values in scope
	declared   map[string]bool   // ARGs declared in the stage (exported to RUN)
	argOrder   []string
	env        map[string]string
	buildArgs  map[string]string
	cmd        *command
	entrypoint *command
	line       int // of the instruction being parsed
}

// command is a CMD or ENTRYPOINT in exec (JSON) or shell form.
type command struct {
	exec  []string
	shell string
}

// warnf records a warning about the instruction being parsed.
func (p *dfParser) warnf(format string, args ...any) {
	p.df.Warnings = append(p.df.Warnings, fmt.Sprintf("line %d: ", p.line)+fmt.Sprintf(format, args...))
}

func (p *dfParser) instruction(l dfLine) error {
	p.line = l.no
	kw, rest, _ := strings.Cut(l.text, " ")
	if i := strings.IndexAny(kw, "\t"); i >= 0 {
		kw, rest = kw[:i], kw[i+1:]+" "+rest
	}
	kw = strings.ToUpper(kw)
	rest = strings.TrimSpace(rest)
	if p.df.From == "" && kw != "FROM" && kw != "ARG" {
		return fmt.Errorf("%s before FROM", kw)
	}
	if strings.Contains(rest, "<<") && (kw == "RUN" || kw == "COPY" || kw == "ADD") && heredoc(rest) {
		return errors.New("heredocs are not supported")
	}
	switch kw {
	case "FROM":
		return p.from(rest)
	case "ARG":
		return p.arg(rest)
	case "RUN":
		return p.run(rest)
	case "ENV":
		return p.envInstr(rest)
	case "WORKDIR":
		dir, err := p.expand(rest)
		if err != nil || dir == "" {
			return errors.Join(errors.New("WORKDIR needs a directory"), err)
		}
		p.df.Steps = append(p.df.Steps, Step{Type: StepWorkdir, Args: []string{dir}})
	case "USER":
		u, err := p.expand(rest)
		if err != nil {
			return err
		}
		if !userName.MatchString(u) {
			return fmt.Errorf("USER %q is not a user name or uid", u)
		}
		p.df.SetsUser = true
		p.df.Steps = append(p.df.Steps, Step{Type: StepUser, Args: []string{u}})
	case "EXPOSE":
		ports, err := p.expand(rest)
		if err != nil {
			return err
		}
		for _, port := range strings.Fields(ports) {
			num, _, _ := strings.Cut(port, "/")
			if n, err := strconv.Atoi(num); err != nil || n < 1 || n > 65535 {
				return fmt.Errorf("EXPOSE %q is not a port", port)
			}
			p.df.Expose = append(p.df.Expose, port)
		}
	case "LABEL":
		kv, err := p.pairs(rest, "LABEL")
		if err != nil {
			return err
		}
		for i := 0; i < len(kv); i += 2 {
			p.df.Labels[kv[i]] = kv[i+1]
		}
	case "COPY", "ADD":
		return p.copyInstr(kw, rest)
	case "CMD", "ENTRYPOINT":
		c, err := parseCommand(rest)
		if err != nil {
			return fmt.Errorf("%s: %w", kw, err)
		}
		if kw == "CMD" {
			p.cmd = c
		} else {
			p.entrypoint = c
			p.cmd = nil // Docker: ENTRYPOINT resets a CMD inherited or set before it
		}
	case "HEALTHCHECK":
		return p.healthcheck(rest)
	case "VOLUME", "STOPSIGNAL", "MAINTAINER", "ONBUILD":
		p.warnf("%s has no effect on templates; ignored", kw)
	case "SHELL":
		return errors.New("SHELL is not supported (steps run with /bin/bash -l -c)")
	default:
		return fmt.Errorf("unknown instruction %q", kw)
	}
	return nil
}

func (p *dfParser) from(rest string) error {
	if p.df.From != "" {
		return errors.New("multi-stage Dockerfiles are not supported (a second FROM)")
	}
	fields := strings.Fields(rest)
	for len(fields) > 0 && strings.HasPrefix(fields[0], "--") {
		if !strings.HasPrefix(fields[0], "--platform=") {
			return fmt.Errorf("FROM flag %s is not supported", fields[0])
		}
		p.warnf("FROM %s has no effect: the node pulls the image for its own platform", fields[0])
		fields = fields[1:]
	}
	switch {
	case len(fields) == 1:
	case len(fields) == 3 && strings.EqualFold(fields[1], "AS"):
	default:
		return errors.New("FROM wants IMAGE [AS NAME]")
	}
	img, err := p.expand(fields[0])
	if err != nil {
		return err
	}
	if img == "" || img == "scratch" {
		return fmt.Errorf("FROM %q: the base must be an image with a shell", fields[0])
	}
	p.df.From = img
	// Docker: ARGs declared before FROM are only usable in FROM unless redeclared.
	p.declared = map[string]bool{}
	p.argOrder = nil
	return nil
}

func (p *dfParser) arg(rest string) error {
	for _, f := range strings.Fields(rest) {
		name, def, hasDef := strings.Cut(f, "=")
		if !envKey.MatchString(name) {
			return fmt.Errorf("ARG name %q is invalid", name)
		}
		if hasDef {
			v, err := p.expand(unquote(def))
			if err != nil {
				return err
			}
			def = v
		}
		val, ok := p.buildArgs[name]
		switch {
		case ok:
		case hasDef:
			val = def
		default:
			if v, had := p.args[name]; had {
				val = v // an ARG redeclared after FROM keeps the global value
			}
		}
		p.args[name] = val
		if p.df.From != "" && !p.declared[name] {
			p.declared[name] = true
			p.argOrder = append(p.argOrder, name)
		}
	}
	return nil
}

func (p *dfParser) run(rest string) error {
	if strings.HasPrefix(rest, "--") {
		flag, _, _ := strings.Cut(rest, " ")
		return fmt.Errorf("RUN flag %s is not supported", flag)
	}
	c, err := parseCommand(rest)
	if err != nil {
		return fmt.Errorf("RUN: %w", err)
	}
	script := c.shell
	if c.exec != nil {
		script = image.ShellJoin(c.exec)
	}
	if strings.TrimSpace(script) == "" {
		return errors.New("RUN needs a command")
	}
	// Build args are environment variables of RUN commands (not of the template).
	var exports []string
	for _, name := range p.argOrder {
		if _, isEnv := p.env[name]; isEnv {
			continue // ENV wins over ARG
		}
		exports = append(exports, name+"="+image.ShellJoin([]string{p.args[name]}))
	}
	if len(exports) > 0 {
		script = "export " + strings.Join(exports, " ") + "; " + script
	}
	p.df.Steps = append(p.df.Steps, Step{Type: StepRun, Args: []string{script}})
	return nil
}

func (p *dfParser) envInstr(rest string) error {
	kv, err := p.pairs(rest, "ENV")
	if err != nil {
		return err
	}
	for i := 0; i < len(kv); i += 2 {
		if !envKey.MatchString(kv[i]) {
			return fmt.Errorf("ENV name %q is invalid", kv[i])
		}
		p.env[kv[i]] = kv[i+1]
	}
	p.df.Steps = append(p.df.Steps, Step{Type: StepEnv, Args: kv})
	return nil
}

// pairs parses `KEY=VALUE ...` (values may be quoted) or the legacy `KEY VALUE` form,
// expanding variables in values.
func (p *dfParser) pairs(rest, kw string) ([]string, error) {
	words, err := shellWords(rest)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", kw, err)
	}
	if len(words) == 0 {
		return nil, fmt.Errorf("%s needs KEY=VALUE", kw)
	}
	if !strings.Contains(words[0].raw, "=") {
		// Legacy form: the rest of the line is the value.
		key := words[0].raw
		val := strings.TrimSpace(strings.TrimPrefix(strings.TrimSpace(rest), key))
		if val == "" {
			return nil, fmt.Errorf("%s %s needs a value", kw, key)
		}
		v, err := p.expand(unquote(val))
		if err != nil {
			return nil, err
		}
		return []string{key, v}, nil
	}
	var out []string
	for _, w := range words {
		k, v, ok := strings.Cut(w.raw, "=")
		if !ok || k == "" {
			return nil, fmt.Errorf("%s: %q is not KEY=VALUE", kw, w.raw)
		}
		val, err := p.expand(v)
		if err != nil {
			return nil, err
		}
		out = append(out, unquote(k), unquote(val))
	}
	return out, nil
}

func (p *dfParser) copyInstr(kw, rest string) error {
	var owner, mode string
	words, err := shellWords(rest)
	if err != nil {
		return fmt.Errorf("%s: %w", kw, err)
	}
	for len(words) > 0 && strings.HasPrefix(words[0].raw, "--") {
		flag, val, _ := strings.Cut(words[0].raw, "=")
		switch flag {
		case "--chown":
			if owner, err = p.expand(val); err != nil {
				return err
			}
			if !userName.MatchString(owner) {
				return fmt.Errorf("%s --chown=%q is not user[:group]", kw, owner)
			}
		case "--chmod":
			if !modeOctal.MatchString(val) {
				return fmt.Errorf("%s --chmod=%q is not an octal mode", kw, val)
			}
			mode = fmt.Sprintf("%04s", val)
		case "--from":
			return fmt.Errorf("%s --from is not supported (single-stage Dockerfiles only)", kw)
		case "--link":
			// A layering hint without an effect on the result here.
		case "--parents":
			return fmt.Errorf("%s --parents is not supported (it would copy the sources without their parent directories)", kw)
		default:
			return fmt.Errorf("%s flag %s is not supported", kw, flag)
		}
		words = words[1:]
	}
	var args []string
	if len(words) > 0 && strings.HasPrefix(words[0].raw, "[") {
		if err := json.Unmarshal([]byte(strings.TrimSpace(rest[strings.Index(rest, "["):])), &args); err != nil {
			return fmt.Errorf("%s: bad JSON form: %w", kw, err)
		}
	} else {
		for _, w := range words {
			args = append(args, unquote(w.raw))
		}
	}
	if len(args) < 2 {
		return fmt.Errorf("%s needs at least one source and a destination", kw)
	}
	dest, err := p.expand(args[len(args)-1])
	if err != nil {
		return err
	}
	if owner == "" {
		owner = "root" // Docker's default owner of copied files
	}
	for _, src := range args[:len(args)-1] {
		if src, err = p.expand(src); err != nil {
			return err
		}
		if kw == "ADD" && (strings.Contains(src, "://") || strings.HasPrefix(src, "git@")) {
			return fmt.Errorf("ADD from a URL (%s) is not supported; download it in a RUN step", src)
		}
		clean, err := ContextPath(src)
		if err != nil {
			return fmt.Errorf("%s %s: %w", kw, src, err)
		}
		d := dest
		if len(args) > 2 && !strings.HasSuffix(d, "/") {
			d += "/" // several sources: the destination is a directory
		}
		if kw == "ADD" && localArchive(clean) {
			p.addArchive(clean, d)
			continue
		}
		p.df.Steps = append(p.df.Steps, Step{Type: StepCopy, Args: []string{clean, d, owner, mode}})
	}
	return nil
}

// archiveSuffixes are the names of the local archives ADD extracts, as Docker does (Docker
// looks at the content; a name is what is known before the context is read).
var archiveSuffixes = []string{".tar", ".tar.gz", ".tgz", ".tar.bz2", ".tbz2", ".tar.xz", ".txz"}

func localArchive(src string) bool {
	for _, s := range archiveSuffixes {
		if strings.HasSuffix(strings.ToLower(src), s) {
			return true
		}
	}
	return false
}

// addArchive makes ADD of a local tar archive extract it into dest (a directory), as Docker
// does: the archive is copied to a scratch directory, unpacked as root (keeping the owners
// and modes it records) and removed.
func (p *dfParser) addArchive(src, dest string) {
	tmp := fmt.Sprintf("/tmp/.aenv-add-%d", len(p.df.Steps))
	archive := tmp + "/" + path.Base(src)
	p.df.Steps = append(p.df.Steps,
		Step{Type: StepCopy, Args: []string{src, tmp + "/", "root", ""}},
		Step{Type: StepRun, Args: []string{"mkdir -p " + image.ShellJoin([]string{dest}) + " && tar -xf " +
			image.ShellJoin([]string{archive}) + " -C " + image.ShellJoin([]string{dest}) + " && rm -rf " +
			image.ShellJoin([]string{tmp}), "root"}})
}

// ContextPath cleans a COPY source relative to the build context and refuses paths that
// leave it.
func ContextPath(src string) (string, error) {
	if src == "" || strings.ContainsRune(src, 0) {
		return "", errors.New("empty source")
	}
	for _, el := range strings.Split(src, "/") {
		if el == ".." {
			return "", errors.New("source leaves the build context")
		}
	}
	c := strings.TrimPrefix(path.Clean("/"+src), "/")
	if c == "" {
		c = "."
	}
	return c, nil
}

func (p *dfParser) healthcheck(rest string) error {
	fields := strings.Fields(rest)
	if len(fields) == 1 && strings.EqualFold(fields[0], "NONE") {
		p.df.ReadyCmd = ""
		return nil
	}
	for len(fields) > 0 && strings.HasPrefix(fields[0], "--") {
		// Intervals and retries: the build's ready wait has its own.
		p.warnf("HEALTHCHECK %s has no effect: the ready command is polled until it succeeds", fields[0])
		fields = fields[1:]
	}
	if len(fields) < 2 || !strings.EqualFold(fields[0], "CMD") {
		return errors.New("HEALTHCHECK wants [OPTIONS] CMD command")
	}
	c, err := parseCommand(strings.TrimSpace(rest[strings.Index(strings.ToUpper(rest), "CMD")+3:]))
	if err != nil {
		return fmt.Errorf("HEALTHCHECK: %w", err)
	}
	if c.exec != nil {
		p.df.ReadyCmd = image.ShellJoin(c.exec)
	} else {
		p.df.ReadyCmd = c.shell
	}
	return nil
}

func parseCommand(rest string) (*command, error) {
	if strings.HasPrefix(rest, "[") {
		var argv []string
		if err := json.Unmarshal([]byte(rest), &argv); err == nil {
			return &command{exec: argv}, nil
		}
		// Docker falls back to the shell form when the JSON does not parse.
	}
	return &command{shell: rest}, nil
}

// startCommand combines ENTRYPOINT and CMD the way Docker does into one shell command.
func startCommand(entry, cmd *command) string {
	switch {
	case entry == nil && cmd == nil:
		return ""
	case entry == nil:
		if cmd.exec != nil {
			return image.ShellJoin(cmd.exec)
		}
		return cmd.shell
	case entry.exec == nil:
		return entry.shell // shell-form ENTRYPOINT ignores CMD
	case cmd == nil:
		return image.ShellJoin(entry.exec)
	case cmd.exec != nil:
		return image.ShellJoin(append(append([]string{}, entry.exec...), cmd.exec...))
	default:
		return image.ShellJoin(append(append([]string{}, entry.exec...), "/bin/sh", "-c", cmd.shell))
	}
}

// SpecFromDockerfile turns a parsed Dockerfile into a build spec with E2B's conventions:
// steps run as root as in Docker, and a file without USER leaves the template's default
// user as the image's USER, or `user` (what the SDKs expect) when the image has none.
// EXPOSE and LABEL become steps that record them in the template.
func (d *Dockerfile) Spec() Spec {
	steps := append([]Step{{Type: StepUser, Args: []string{"root"}}}, d.Steps...)
	if len(d.Expose) > 0 {
		steps = append(steps, Step{Type: StepExpose, Args: slices.Clone(d.Expose)})
	}
	if len(d.Labels) > 0 {
		var kv []string
		for _, k := range slices.Sorted(maps.Keys(d.Labels)) {
			kv = append(kv, k, d.Labels[k])
		}
		steps = append(steps, Step{Type: StepLabel, Args: kv})
	}
	if !d.SetsUser {
		// Back to the image's USER (or `user`): the template's default.
		steps = append(steps, Step{Type: StepDefaultUser})
	}
	return Spec{FromImage: d.From, StartCmd: d.StartCmd, ReadyCmd: d.ReadyCmd, Steps: steps}
}
