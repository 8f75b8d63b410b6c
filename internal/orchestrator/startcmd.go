package orchestrator

import (
	"cmp"
	"context"
	"fmt"

	"github.com/aenv-dev/aenv/internal/envdclient"
	"github.com/aenv-dev/aenv/internal/sandbox"
)

// startCmdTag is the envd process tag of a template's start command, so users can find
// it with commands.list() and reattach to its output.
const startCmdTag = "start-cmd"

// runsFreshProcesses says whether a launch boots the sandbox's processes anew (so the
// template's start command must run again) rather than continuing them from memory.
func runsFreshProcesses(plan sandbox.LaunchPlan, caps sandbox.Capabilities) bool {
	switch {
	case plan.Kind == sandbox.LaunchFresh, plan.ColdBoot:
		return true
	case plan.Kind == sandbox.LaunchFromSnapshot:
		return !caps.MemorySnapshots
	default: // LaunchResume continues the paused processes
		return false
	}
}

// startTemplateCommand starts the template's start command in the background through
// envd, as the template's default user in its workdir, and returns once envd reports
// the process started. E2B templates capture a running start command in their memory
// snapshot; a backend that boots fresh processes has to start it again instead.
func (o *Orchestrator) startTemplateCommand(ctx context.Context, ep sandbox.Endpoint, rec *Sandbox) error {
	cmd := rec.Launch.StartCmd
	if cmd == "" {
		return nil
	}
	// The stream outlives the operation: it carries the output into the sandbox's logs
	// (logs.go) until the process ends or the sandbox goes. Only starting is bounded by ctx.
	client := envdclient.New(o.streamClient(), o.envdURL(ep), envdclient.WithAccessToken(rec.EnvdAccessToken))
	fctx, cancel := context.WithCancel(context.WithoutCancel(ctx))
	stop := context.AfterFunc(ctx, cancel)
	p, err := client.Start(fctx, envdclient.Command{
		Cmd:  "/bin/bash",
		Args: []string{"-l", "-c", cmd},
		Cwd:  cmp.Or(rec.Launch.DefaultWorkdir, defaultWorkdir),
		User: cmp.Or(rec.Launch.DefaultUser, defaultUser),
		Tag:  startCmdTag,
	})
	if !stop() || err != nil {
		cancel()
		if err == nil {
			p.Close()
			err = ctx.Err()
		}
		// ErrNoStart's text keeps the message this returned before envdclient existed.
		return fmt.Errorf("start command: %w", err)
	}
	o.followStartCommand(rec.ID, p, cancel)
	return nil
}
