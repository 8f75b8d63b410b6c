package bench

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"time"
)

// SDKOptions configures a run of the SDK benchmark script (test/e2e/bench.mjs), which does
// what RunCreate does through the real E2B JS SDK: Sandbox.create() then
// sbx.commands.run('true').
type SDKOptions struct {
	Script string // path to bench.mjs
	Node   string // node binary; default "node"
	URL    string // the node, given to the SDK as E2B_API_URL and E2B_SANDBOX_URL
	APIKey string
	CreateOptions
}

// sdkOutput is the JSON the script prints on stdout: every sample, so percentiles are
// computed here the same way as for the REST path.
type sdkOutput struct {
	Mode        string  `json:"mode"`
	Concurrency int     `json:"concurrency"`
	WallMs      float64 `json:"wallMs"`
	ClientCPUMs float64 `json:"clientCpuMs"`
	Samples     []struct {
		CreateMs  float64 `json:"createMs"`
		CommandMs float64 `json:"commandMs"`
		ClientMs  float64 `json:"clientMs"` // absent (0): not measured
		Error     string  `json:"error,omitempty"`
	} `json:"samples"`
}

// RunSDK runs the script once and summarizes its samples.
func RunSDK(ctx context.Context, o SDKOptions) (Result, error) {
	if o.Node == "" {
		o.Node = "node"
	}
	if o.Gap != 0 {
		return Result{}, fmt.Errorf("bench: the SDK script takes no gap between sandboxes (%v asked)", o.Gap)
	}
	if _, err := os.Stat(o.Script); err != nil {
		return Result{}, fmt.Errorf("bench: SDK script: %w (run from the repository root or pass --sdk-script)", err)
	}
	args := []string{o.Script,
		"--n", strconv.Itoa(o.N), "--concurrency", strconv.Itoa(o.Concurrency),
		"--warmup", strconv.Itoa(o.Warmup), "--template", o.Template,
	}
	cmd := exec.CommandContext(ctx, o.Node, args...)
	cmd.Env = append(os.Environ(), "E2B_API_URL="+o.URL, "E2B_SANDBOX_URL="+o.URL, "E2B_API_KEY="+o.APIKey)
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	cpu := beginCPU(ctx, o.CPU)
	if err := cmd.Run(); err != nil {
		return Result{}, fmt.Errorf("bench: %s %s: %w: %s", o.Node, o.Script, err, lastLines(stderr.String(), 5))
	}
	r, err := parseSDKOutput(stdout.Bytes())
	if err != nil {
		return r, err
	}
	// The script's warm-up sandboxes run inside the window: they are counted as operations.
	r.CPU = cpu.end(ctx, o.N+o.Warmup)
	return r, nil
}

func parseSDKOutput(raw []byte) (Result, error) {
	var out sdkOutput
	if err := json.Unmarshal(raw, &out); err != nil {
		return Result{}, fmt.Errorf("bench: SDK script output: %w: %s", err, lastLines(string(raw), 3))
	}
	if len(out.Samples) == 0 {
		return Result{}, fmt.Errorf("bench: SDK script reported no samples")
	}
	samples := make([]sample, len(out.Samples))
	for i, s := range out.Samples {
		samples[i] = sample{create: msDuration(s.CreateMs), command: msDuration(s.CommandMs), client: msDuration(s.ClientMs)}
		if s.Error != "" {
			samples[i].err = fmt.Errorf("%s", s.Error)
		}
	}
	r := summarizeRun("sdk", out.Concurrency, samples, msDuration(out.WallMs))
	r.ClientCPU = msDuration(out.ClientCPUMs)
	return r, nil
}

func msDuration(ms float64) time.Duration { return time.Duration(ms * float64(time.Millisecond)) }

func lastLines(s string, n int) string {
	lines := strings.Split(strings.TrimSpace(s), "\n")
	return strings.Join(lines[max(0, len(lines)-n):], "\n")
}
