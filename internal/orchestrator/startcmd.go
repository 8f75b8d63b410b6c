package orchestrator

import (
	"cmp"
	"context"
	"encoding/base64"
	"fmt"

	"connectrpc.com/connect"

	processpb "github.com/aenv-dev/aenv/internal/envd/gen/process"
	"github.com/aenv-dev/aenv/internal/envd/gen/process/processconnect"
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
	client := processconnect.NewProcessClient(o.envd, o.envdURL(ep))
	workdir := cmp.Or(rec.Launch.DefaultWorkdir, defaultWorkdir)
	tag := startCmdTag
	noStdin := false
	req := connect.NewRequest(&processpb.StartRequest{
		Process: &processpb.ProcessConfig{Cmd: "/bin/bash", Args: []string{"-l", "-c", cmd}, Cwd: &workdir},
		Tag:     &tag,
		Stdin:   &noStdin,
	})
	user := cmp.Or(rec.Launch.DefaultUser, defaultUser)
	req.Header().Set("Authorization", "Basic "+base64.StdEncoding.EncodeToString([]byte(user+":")))
	if rec.EnvdAccessToken != "" {
		req.Header().Set("X-Access-Token", rec.EnvdAccessToken)
	}
	// The process outlives this stream: envd keeps it running when the client goes away.
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	stream, err := client.Start(ctx, req)
	if err != nil {
		return fmt.Errorf("start command: %w", err)
	}
	defer stream.Close()
	for stream.Receive() {
		if stream.Msg().GetEvent().GetStart() != nil {
			return nil
		}
	}
	if err := stream.Err(); err != nil {
		return fmt.Errorf("start command: %w", err)
	}
	return fmt.Errorf("start command: envd closed the stream before the process started")
}
