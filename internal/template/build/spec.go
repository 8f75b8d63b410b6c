package build

import (
	"errors"
	"fmt"
	"regexp"
	"strconv"
	"strings"

	"github.com/aenv-dev/aenv/internal/image"
)

// Step types, as the E2B SDKs send them in TemplateBuildStartV2.steps.
const (
	StepRun     = "RUN"
	StepEnv     = "ENV"
	StepWorkdir = "WORKDIR"
	StepUser    = "USER"
	StepCopy    = "COPY"
	// aenv's own step types, for Dockerfile instructions the E2B SDKs have no step for.
	StepExpose = "EXPOSE"
	StepLabel  = "LABEL"
	// StepDefaultUser switches back to the user the build started as: the image's USER,
	// else the base template's default user, else `user`. A Dockerfile without USER
	// ends with it, so its steps run as root (as in Docker) and its template keeps the
	// image's user.
	StepDefaultUser = "DEFAULT_USER"
)

// Step is one build instruction. Args by type (the E2B SDK's encoding):
//
//	RUN     [command, user?]            command runs with /bin/bash -l -c
//	ENV     [key, value, key, value...]
//	WORKDIR [dir]
//	USER    [user]
//	COPY    [src, dest, owner?, mode?]  files come from the upload named by FilesHash
//	EXPOSE  [port[/proto]...]           recorded in the template (catalog ExposedPorts)
//	LABEL   [key, value, key, value...] recorded in the template (catalog Labels)
//	DEFAULT_USER []                      see StepDefaultUser
type Step struct {
	Type      string   `json:"type"`
	Args      []string `json:"args,omitempty"`
	FilesHash string   `json:"filesHash,omitempty"`
	Force     bool     `json:"force,omitempty"`
}

// Spec is what a build starts from and does (TemplateBuildStartV2).
type Spec struct {
	FromImage    string `json:"fromImage,omitempty"`
	FromTemplate string `json:"fromTemplate,omitempty"`
	StartCmd     string `json:"startCmd,omitempty"`
	ReadyCmd     string `json:"readyCmd,omitempty"`
	Steps        []Step `json:"steps,omitempty"`
	// Force is E2B's force / skipCache: run the whole build regardless of caches.
	// Builds here keep no step cache (every step always runs) and always resolve
	// fromImage's tag again; only the image import is reused, keyed by manifest
	// digest, so it is the same content. Force is kept for the record and logged.
	Force bool `json:"force,omitempty"`
	// Registry holds credentials for FromImage's registry (E2B's fromImageRegistry
	// of type "registry"). Never written to disk: a build that outlives its process
	// fails anyway, so nothing needs them after it.
	Registry *image.Credentials `json:"-"`
}

// ErrInvalidSpec is wrapped by every validation failure of a build request.
var ErrInvalidSpec = errors.New("invalid build")

var (
	envKey    = regexp.MustCompile(`^[A-Za-z_][A-Za-z0-9_]*$`)
	userName  = regexp.MustCompile(`^[A-Za-z0-9_][A-Za-z0-9_.-]*(:[A-Za-z0-9_][A-Za-z0-9_.-]*)?$`)
	filesHash = regexp.MustCompile(`^[A-Za-z0-9]{1,128}$`)
	modeOctal = regexp.MustCompile(`^[0-7]{3,4}$`)
)

// ValidHash reports whether h can name an uploaded file set (it becomes a file name).
func ValidHash(h string) bool { return filesHash.MatchString(h) }

// Validate checks a spec before anything runs, so bad input fails the request instead
// of a build.
func (s Spec) Validate() error {
	switch {
	case s.FromImage != "" && s.FromTemplate != "":
		return fmt.Errorf("%w: give fromImage or fromTemplate, not both", ErrInvalidSpec)
	case s.FromImage == "" && s.FromTemplate == "":
		return fmt.Errorf("%w: fromImage or fromTemplate is required", ErrInvalidSpec)
	}
	if s.Registry != nil && s.FromImage == "" {
		return fmt.Errorf("%w: registry credentials need fromImage", ErrInvalidSpec)
	}
	if s.Registry != nil && (s.Registry.Username == "" || s.Registry.Password == "") {
		return fmt.Errorf("%w: registry credentials need both a username and a password", ErrInvalidSpec)
	}
	for i, st := range s.Steps {
		if err := st.validate(); err != nil {
			return fmt.Errorf("%w: step %d (%s): %w", ErrInvalidSpec, i+1, st.Type, err)
		}
	}
	return nil
}

func (st Step) validate() error {
	a := st.Args
	switch st.Type {
	case StepRun:
		if len(a) < 1 || len(a) > 2 || strings.TrimSpace(a[0]) == "" {
			return errors.New("want [command] or [command, user]")
		}
		if len(a) == 2 && a[1] != "" && !userName.MatchString(a[1]) {
			return fmt.Errorf("bad user %q", a[1])
		}
	case StepEnv:
		if len(a) == 0 || len(a)%2 != 0 {
			return errors.New("want key/value pairs")
		}
		for i := 0; i < len(a); i += 2 {
			if !envKey.MatchString(a[i]) {
				return fmt.Errorf("bad variable name %q", a[i])
			}
		}
	case StepWorkdir:
		if len(a) != 1 || a[0] == "" || strings.ContainsRune(a[0], 0) {
			return errors.New("want [dir]")
		}
	case StepUser:
		if len(a) != 1 || !userName.MatchString(a[0]) {
			return errors.New("want [user] (a user name or uid, optionally :group)")
		}
	case StepCopy:
		if len(a) < 2 || len(a) > 4 || a[0] == "" || a[1] == "" {
			return errors.New("want [src, dest, owner?, mode?]")
		}
		if len(a) > 2 && a[2] != "" && !userName.MatchString(a[2]) {
			return fmt.Errorf("bad owner %q", a[2])
		}
		if len(a) > 3 && a[3] != "" && !modeOctal.MatchString(a[3]) {
			return fmt.Errorf("bad mode %q (octal, e.g. 0755)", a[3])
		}
		if !ValidHash(st.FilesHash) {
			return errors.New("filesHash is required (upload the files first)")
		}
	case StepExpose:
		if len(a) == 0 {
			return errors.New("want [port...]")
		}
		for _, p := range a {
			num, _, _ := strings.Cut(p, "/")
			if n, err := strconv.Atoi(num); err != nil || n < 1 || n > 65535 || strings.ContainsAny(p, " \t\x00") {
				return fmt.Errorf("%q is not a port", p)
			}
		}
	case StepLabel:
		if len(a) == 0 || len(a)%2 != 0 {
			return errors.New("want key/value pairs")
		}
	case StepDefaultUser:
		if len(a) != 0 {
			return errors.New("takes no arguments")
		}
	default:
		return fmt.Errorf("unsupported step type %q (RUN, ENV, WORKDIR, USER, COPY, EXPOSE, LABEL, DEFAULT_USER)", st.Type)
	}
	return nil
}
