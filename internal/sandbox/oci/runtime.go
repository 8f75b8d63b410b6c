package oci

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"strings"
)

// errNoContainer means the runtime has no container of that id.
var errNoContainer = errors.New("oci: no such container")

// runtimeCLI drives an OCI runtime binary (runc, crun, runsc) with its own state root, so
// our containers never mix with anything else on the host.
type runtimeCLI struct {
	name string // runc | crun | runsc
	bin  string // resolved path
	root string // --root: the runtime's state directory
}

// containerState is the subset of `state`/`list -f json` output we use.
type containerState struct {
	ID     string `json:"id"`
	Pid    int    `json:"pid"`
	Status string `json:"status"` // created | running | paused | stopped
	Bundle string `json:"bundle"`
}

func (r runtimeCLI) command(ctx context.Context, args ...string) *exec.Cmd {
	full := append([]string{"--root", r.root}, args...)
	cmd := exec.CommandContext(ctx, r.bin, full...)
	cmd.WaitDelay = 0
	return cmd
}

func (r runtimeCLI) output(ctx context.Context, args ...string) ([]byte, error) {
	cmd := r.command(ctx, args...)
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := cmd.Run(); err != nil {
		msg := strings.TrimSpace(stderr.String())
		if strings.Contains(msg, "does not exist") || strings.Contains(msg, "not found") || strings.Contains(msg, "container not found") {
			return nil, fmt.Errorf("%w: %s %s: %s", errNoContainer, r.name, args[0], msg)
		}
		return nil, fmt.Errorf("oci: %s %s: %w: %s", r.name, strings.Join(args, " "), err, msg)
	}
	return stdout.Bytes(), nil
}

// runDetached creates and starts the container; it returns once the init has been exec'd.
// The init's stdio goes to logPath (a file, so no pipe ties our process to the container).
func (r runtimeCLI) runDetached(ctx context.Context, id, bundle, pidFile, logPath string) error {
	logf, err := os.OpenFile(logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		return fmt.Errorf("oci: init log: %w", err)
	}
	defer logf.Close()
	cmd := r.command(ctx, "run", "--detach", "--no-new-keyring", "--pid-file", pidFile, "--bundle", bundle, id)
	cmd.Stdin = nil
	cmd.Stdout, cmd.Stderr = logf, logf
	if err := cmd.Run(); err != nil {
		tail, _ := os.ReadFile(logPath)
		if len(tail) > 2000 {
			tail = tail[len(tail)-2000:]
		}
		return fmt.Errorf("oci: %s run %s: %w: %s", r.name, id, err, strings.TrimSpace(string(tail)))
	}
	return nil
}

// create creates the container without starting its init (the warm pool); start runs it.
func (r runtimeCLI) create(ctx context.Context, id, bundle, pidFile, logPath string) error {
	logf, err := os.OpenFile(logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		return fmt.Errorf("oci: init log: %w", err)
	}
	defer logf.Close()
	cmd := r.command(ctx, "create", "--no-new-keyring", "--pid-file", pidFile, "--bundle", bundle, id)
	cmd.Stdout, cmd.Stderr = logf, logf
	if err := cmd.Run(); err != nil {
		tail, _ := os.ReadFile(logPath)
		if len(tail) > 2000 {
			tail = tail[len(tail)-2000:]
		}
		return fmt.Errorf("oci: %s create %s: %w: %s", r.name, id, err, strings.TrimSpace(string(tail)))
	}
	return nil
}

func (r runtimeCLI) start(ctx context.Context, id string) error {
	_, err := r.output(ctx, "start", id)
	return err
}

// runForeground runs a container to completion (used by the probe).
func (r runtimeCLI) runForeground(ctx context.Context, id, bundle string) ([]byte, error) {
	cmd := r.command(ctx, "run", "--no-new-keyring", "--bundle", bundle, id)
	out, err := cmd.CombinedOutput()
	if err != nil {
		return out, fmt.Errorf("oci: %s run: %w: %s", r.name, err, strings.TrimSpace(string(out)))
	}
	return out, nil
}

func (r runtimeCLI) state(ctx context.Context, id string) (containerState, error) {
	out, err := r.output(ctx, "state", id)
	if err != nil {
		return containerState{}, err
	}
	var st containerState
	if err := json.Unmarshal(out, &st); err != nil {
		return containerState{}, fmt.Errorf("oci: %s state %s: %w", r.name, id, err)
	}
	return st, nil
}

func (r runtimeCLI) list(ctx context.Context) ([]containerState, error) {
	if _, err := os.Stat(r.root); errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	out, err := r.output(ctx, "list", "--format", "json")
	if err != nil {
		return nil, err
	}
	var sts []containerState
	if s := strings.TrimSpace(string(out)); s == "" || s == "null" {
		return nil, nil
	}
	if err := json.Unmarshal(out, &sts); err != nil {
		return nil, fmt.Errorf("oci: %s list: %w", r.name, err)
	}
	return sts, nil
}

func (r runtimeCLI) pause(ctx context.Context, id string) error {
	_, err := r.output(ctx, "pause", id)
	return err
}

func (r runtimeCLI) resume(ctx context.Context, id string) error {
	_, err := r.output(ctx, "resume", id)
	return err
}

// remove kills every process of the container and deletes it; a missing container is fine.
func (r runtimeCLI) remove(ctx context.Context, id string) error {
	if _, err := r.output(ctx, "delete", "--force", id); err != nil && !errors.Is(err, errNoContainer) {
		return err
	}
	return nil
}
