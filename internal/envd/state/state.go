// Package state holds what POST /init sets: the sandbox environment, the access token, the default
// user and working directory. Every service reads it through a consistent snapshot.
package state

import (
	"crypto/subtle"
	"maps"
	"sync"
	"time"
)

// Defaults is safe for concurrent use.
type Defaults struct {
	mu       sync.RWMutex
	envVars  map[string]string
	token    string
	user     string
	workdir  string
	lastInit time.Time
}

// New returns defaults with the given user (envd's own default is root) and no token.
func New(defaultUser string) *Defaults {
	return &Defaults{envVars: map[string]string{}, user: defaultUser}
}

// Snapshot is a copy of the defaults at one moment.
type Snapshot struct {
	EnvVars map[string]string // sandbox env (from /init) plus E2B_SANDBOX=true; never nil
	User    string
	Workdir string
}

// Snapshot returns a copy; the map may be read freely.
func (d *Defaults) Snapshot() Snapshot {
	d.mu.RLock()
	defer d.mu.RUnlock()
	env := make(map[string]string, len(d.envVars)+1)
	env["E2B_SANDBOX"] = "true"
	maps.Copy(env, d.envVars)
	return Snapshot{EnvVars: env, User: d.user, Workdir: d.workdir}
}

// HasToken reports whether an access token was set.
func (d *Defaults) HasToken() bool {
	d.mu.RLock()
	defer d.mu.RUnlock()
	return d.token != ""
}

// Token returns the access token ("" when none).
func (d *Defaults) Token() string {
	d.mu.RLock()
	defer d.mu.RUnlock()
	return d.token
}

// CheckToken compares got with the access token in constant time; with no token set it accepts anything.
func (d *Defaults) CheckToken(got string) bool {
	d.mu.RLock()
	tok := d.token
	d.mu.RUnlock()
	if tok == "" {
		return true
	}
	return subtle.ConstantTimeCompare([]byte(got), []byte(tok)) == 1
}

// Init is the accepted part of a POST /init body; nil fields are left unchanged.
type Init struct {
	EnvVars        map[string]string
	AccessToken    *string
	DefaultUser    *string
	DefaultWorkdir *string
	Timestamp      time.Time // zero: always apply
}

// Apply stores in; it returns false (and changes nothing) when in.Timestamp is older than the last applied one.
func (d *Defaults) Apply(in Init) bool {
	d.mu.Lock()
	defer d.mu.Unlock()
	if !in.Timestamp.IsZero() {
		if !d.lastInit.IsZero() && in.Timestamp.Before(d.lastInit) {
			return false
		}
		d.lastInit = in.Timestamp
	}
	if in.EnvVars != nil {
		maps.Copy(d.envVars, in.EnvVars)
	}
	if in.AccessToken != nil {
		d.token = *in.AccessToken
	}
	if in.DefaultUser != nil && *in.DefaultUser != "" {
		d.user = *in.DefaultUser
	}
	if in.DefaultWorkdir != nil {
		d.workdir = *in.DefaultWorkdir
	}
	return true
}
