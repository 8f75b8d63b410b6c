package server

import (
	"errors"
	"fmt"
	"net/http"
	"strings"
	"time"

	"github.com/aenv-dev/aenv/internal/orchestrator"
	"github.com/aenv-dev/aenv/internal/sandbox"
	"github.com/aenv-dev/aenv/internal/server/api"
)

// createParams is what v1 and v2 creates have in common, before validation.
type createParams struct {
	templateID    string
	timeout       *int32
	metadata      *api.SandboxMetadata
	envVars       *api.EnvVars
	autoPause     *bool
	autoResume    *api.SandboxAutoResumeConfig
	allowInternet *bool
	cpuCount      *int32
	memoryMB      *int32
	network       *api.SandboxNetworkConfig
	secure        bool
	// autoPauseMemory false makes the timeout pause a pause to disk (v2 only).
	autoPauseMemory *bool
	volumeMounts    *[]api.SandboxVolumeMount
	// owner is the authenticated caller's owner (volumes and secrets resolve in it).
	owner string
}

func (h *handlers) CreateSandboxV2(w http.ResponseWriter, r *http.Request) {
	var body api.NewSandboxV2
	if !decodeRequired(w, r, &body) {
		return
	}
	h.create(w, r, createParams{
		templateID: body.TemplateID, timeout: body.Timeout, metadata: body.Metadata, envVars: body.EnvVars,
		autoPause: body.AutoPause, autoResume: body.AutoResume, allowInternet: body.AllowInternetAccess,
		cpuCount: body.CpuCount, memoryMB: body.MemoryMB, network: body.Network,
		// v2 creates are always secure: the SDK expects an envd access token.
		secure: true, autoPauseMemory: body.AutoPauseMemory,
		volumeMounts: body.VolumeMounts, owner: ownerFrom(r.Context()),
	}, h.s.defaultTimeout)
}

func (h *handlers) CreateSandboxV1(w http.ResponseWriter, r *http.Request) {
	var body api.NewSandbox
	if !decodeRequired(w, r, &body) {
		return
	}
	h.create(w, r, createParams{
		templateID: body.TemplateID, timeout: body.Timeout, metadata: body.Metadata, envVars: body.EnvVars,
		autoPause: body.AutoPause, autoResume: body.AutoResume, allowInternet: body.AllowInternetAccess,
		cpuCount: body.CpuCount, memoryMB: body.MemoryMB, network: body.Network,
		secure:       body.Secure != nil && *body.Secure,
		volumeMounts: body.VolumeMounts, owner: ownerFrom(r.Context()),
	}, h.s.defaultTimeoutV1)
}

func (h *handlers) create(w http.ResponseWriter, r *http.Request, p createParams, defTimeout time.Duration) {
	req, err := h.s.createRequest(p, defTimeout)
	if err != nil {
		writeError(w, http.StatusBadRequest, "%s", err.Error())
		return
	}
	// E2B's "name:tag": the builder keeps tags; the orchestrator knows templates only by
	// id and alias.
	if strings.Contains(req.TemplateID, ":") && h.s.builds != nil {
		t, err := h.s.builds.ResolveTag(req.TemplateID)
		if err != nil {
			writeBuildError(w, r, err)
			return
		}
		req.TemplateID = t.ID
	}
	if len(req.VolumeMounts) > 0 {
		// A volume is not deleted while a sandbox that mounts it starts.
		h.s.vols.mu.RLock()
		defer h.s.vols.mu.RUnlock()
	}
	sb, err := h.s.orch.Create(r.Context(), req)
	if err != nil {
		writeOrchError(w, r, err)
		return
	}
	writeJSON(w, http.StatusCreated, h.s.sandboxBody(sb))
}

// createRequest validates a create at the API edge so nothing is started for bad input.
func (s *Server) createRequest(p createParams, defTimeout time.Duration) (orchestrator.CreateRequest, error) {
	var req orchestrator.CreateRequest
	tpl := strings.TrimSpace(p.templateID)
	if tpl == "" {
		return req, fmt.Errorf("templateID is required")
	}
	timeout, err := s.timeoutSeconds(p.timeout, defTimeout)
	if err != nil {
		return req, err
	}
	req = orchestrator.CreateRequest{
		TemplateID:    tpl,
		Timeout:       timeout,
		AllowInternet: p.allowInternet == nil || *p.allowInternet,
		AutoPause:     p.autoPause != nil && *p.autoPause,
		AutoPauseDisk: p.autoPauseMemory != nil && !*p.autoPauseMemory,
		AutoResume:    p.autoResume != nil && p.autoResume.Enabled,
		Secure:        p.secure,
		Private:       p.network != nil && p.network.AllowPublicTraffic != nil && !*p.network.AllowPublicTraffic,
	}
	if req.Egress, err = createEgress(p.network); err != nil {
		return req, err
	}
	if req.MaskRequestHost, err = parseMaskRequestHost(p.network); err != nil {
		return req, err
	}
	if p.metadata != nil {
		if err := checkStringMap("metadata", *p.metadata); err != nil {
			return req, err
		}
		req.Metadata = *p.metadata
	}
	if p.envVars != nil {
		if err := checkStringMap("envVars", *p.envVars); err != nil {
			return req, err
		}
		req.EnvVars = *p.envVars
		if err := s.checkSecretRefs(p.owner, req.EnvVars); err != nil {
			return req, fmt.Errorf("envVars %w", err)
		}
	}
	for host, list := range req.Egress.Rules {
		for _, t := range list {
			if err := s.checkSecretRefs(p.owner, t.Headers); err != nil {
				return req, fmt.Errorf("network.rules[%s]: %w", host, err)
			}
		}
	}
	req.Owner = p.owner
	if req.VolumeMounts, err = s.volumeMounts(p.owner, p.volumeMounts); err != nil {
		return req, err
	}
	if p.cpuCount != nil {
		if *p.cpuCount < 1 || *p.cpuCount > 256 {
			return req, fmt.Errorf("cpuCount must be between 1 and 256, got %d", *p.cpuCount)
		}
		req.Resources.CPUCount = int(*p.cpuCount)
	}
	if p.memoryMB != nil {
		if *p.memoryMB < 64 {
			return req, fmt.Errorf("memoryMB must be at least 64, got %d", *p.memoryMB)
		}
		req.Resources.MemoryMB = int(*p.memoryMB)
	}
	if err := s.capacity.Check(req.Resources); err != nil {
		return req, err
	}
	return req, nil
}

// Size limits of a create's envVars and metadata (docs/api-compatibility.md). Linux refuses
// to exec with one environment string above 128 KiB or with the environment and arguments
// together above a quarter of the stack limit, so larger environments would be accepted
// and then fail every command with "argument list too long".
const (
	maxEnvVarBytes   = 64 << 10  // one NAME=value
	maxEnvVarsBytes  = 256 << 10 // all of them, NAME=value each
	maxMetadataKey   = 256
	maxMetadataBytes = 64 << 10 // keys and values together
)

func checkStringMap(field string, m map[string]string) error {
	total := 0
	for k, v := range m {
		if k == "" {
			return fmt.Errorf("%s keys must not be empty", field)
		}
		switch field {
		case "envVars":
			if strings.ContainsAny(k, "=\x00") {
				return fmt.Errorf("envVars key %q must not contain '=' or NUL", k)
			}
			if strings.Contains(v, "\x00") {
				return fmt.Errorf("envVars value of %q must not contain NUL", k)
			}
			n := len(k) + 1 + len(v)
			if n > maxEnvVarBytes {
				return fmt.Errorf("envVars %q is %d bytes (NAME=value); the limit is %d bytes per variable", k, n, maxEnvVarBytes)
			}
			total += n
		default:
			if len(k) > maxMetadataKey {
				return fmt.Errorf("%s key %.32q... is %d bytes; the limit is %d", field, k, len(k), maxMetadataKey)
			}
			total += len(k) + len(v)
		}
	}
	if field == "envVars" && total > maxEnvVarsBytes {
		return fmt.Errorf("envVars total %d bytes (NAME=value each); the limit is %d bytes", total, maxEnvVarsBytes)
	}
	if field != "envVars" && total > maxMetadataBytes {
		return fmt.Errorf("%s total %d bytes (keys and values); the limit is %d bytes", field, total, maxMetadataBytes)
	}
	return nil
}

func (h *handlers) ConnectSandboxV2(w http.ResponseWriter, r *http.Request, id api.SandboxID) {
	var body api.ConnectSandboxV2
	if !decodeOptional(w, r, &body) {
		return
	}
	h.connect(w, r, id, body.Timeout, false, body.Memory != nil && !*body.Memory)
}

func (h *handlers) ConnectSandboxV1(w http.ResponseWriter, r *http.Request, id api.SandboxID) {
	// The v1 body requires timeout; decode into a pointer to tell "absent" from 0.
	var raw struct {
		Timeout *int32 `json:"timeout"`
		Memory  *bool  `json:"memory"`
	}
	if !decodeRequired(w, r, &raw) {
		return
	}
	if raw.Timeout == nil {
		writeError(w, http.StatusBadRequest, "timeout is required")
		return
	}
	h.connect(w, r, id, raw.Timeout, false, raw.Memory != nil && !*raw.Memory)
}

func (h *handlers) ResumeSandbox(w http.ResponseWriter, r *http.Request, id api.SandboxID) {
	var body api.ResumedSandbox
	if !decodeOptional(w, r, &body) {
		return
	}
	h.connect(w, r, id, body.Timeout, true, false)
}

// HeaderAdopt on a connect or resume lets the node resume a sandbox it does not hold from
// the publication of the node of the cluster that paused it to disk.
const HeaderAdopt = "X-Aenv-Adopt"

// connect serves connect (v1, v2) and the deprecated resume: 200 when the sandbox was
// running (TTL extended only), 201 when it was resumed. resumeOnly answers 409 for a
// sandbox that was not paused, as E2B's resume does. cold is memory:false: a paused
// sandbox restarts its processes on its filesystem instead of restoring memory.
func (h *handlers) connect(w http.ResponseWriter, r *http.Request, id string, timeout *int32, resumeOnly, cold bool) {
	d, err := h.s.timeoutSeconds(timeout, h.s.defaultTimeout)
	if err != nil {
		writeError(w, http.StatusBadRequest, "%s", err.Error())
		return
	}
	// Set by a cluster gateway when the node that paused the sandbox is gone, full or
	// draining: this node may resume it from the pause that node published.
	adopt := r.Header.Get(HeaderAdopt) != ""
	if resumeOnly {
		sb, err := h.s.orch.Get(r.Context(), id)
		switch {
		case errors.Is(err, orchestrator.ErrNotFound) && adopt:
		case err != nil:
			writeOrchError(w, r, err)
			return
		case sb.State.Public() != "paused":
			writeError(w, http.StatusConflict, "sandbox %s is already running", id)
			return
		}
	}
	sb, resumed, err := h.s.orch.Connect(r.Context(), id, orchestrator.ConnectOptions{Timeout: d, ColdBoot: cold, Adopt: adopt})
	if err != nil {
		writeOrchError(w, r, err)
		return
	}
	status := http.StatusOK
	if resumed || resumeOnly {
		status = http.StatusCreated
	}
	writeJSON(w, status, h.s.sandboxBody(sb))
}

func (h *handlers) GetSandbox(w http.ResponseWriter, r *http.Request, id api.SandboxID) {
	sb, err := h.s.orch.Get(r.Context(), id)
	if err != nil {
		writeOrchError(w, r, err)
		return
	}
	writeJSON(w, http.StatusOK, h.s.detailBody(sb))
}

func (h *handlers) KillSandbox(w http.ResponseWriter, r *http.Request, id api.SandboxID) {
	if err := h.s.orch.Kill(r.Context(), id); err != nil {
		writeOrchError(w, r, err)
		return
	}
	w.WriteHeader(http.StatusNoContent)
}

func (h *handlers) SetSandboxTimeout(w http.ResponseWriter, r *http.Request, id api.SandboxID) {
	var raw struct {
		Timeout *int32 `json:"timeout"`
	}
	if !decodeRequired(w, r, &raw) {
		return
	}
	if raw.Timeout == nil {
		writeError(w, http.StatusBadRequest, "timeout is required")
		return
	}
	d := time.Duration(*raw.Timeout) * time.Second
	if d > h.s.maxTimeout {
		writeError(w, http.StatusBadRequest, "timeout must be at most %d seconds, got %d", int(h.s.maxTimeout/time.Second), *raw.Timeout)
		return
	}
	// A zero or negative timeout expires the sandbox now, as in E2B.
	if err := h.s.orch.SetTimeout(r.Context(), id, d); err != nil {
		writeOrchError(w, r, err)
		return
	}
	w.WriteHeader(http.StatusNoContent)
}

func (h *handlers) RefreshSandbox(w http.ResponseWriter, r *http.Request, id api.SandboxID) {
	var body api.SandboxRefreshRequest
	if !decodeOptional(w, r, &body) {
		return
	}
	d := h.s.defaultTimeout
	if body.Duration != nil {
		if *body.Duration < 0 || *body.Duration > 3600 {
			writeError(w, http.StatusBadRequest, "duration must be between 0 and 3600 seconds, got %d", *body.Duration)
			return
		}
		d = time.Duration(*body.Duration) * time.Second
	}
	if err := h.s.orch.Refresh(r.Context(), id, d); err != nil {
		writeOrchError(w, r, err)
		return
	}
	w.WriteHeader(http.StatusNoContent)
}

func (h *handlers) PauseSandbox(w http.ResponseWriter, r *http.Request, id api.SandboxID) {
	var body api.SandboxPauseRequest
	if !decodeOptional(w, r, &body) {
		return
	}
	keep := body.Memory == nil || *body.Memory
	if err := h.s.orch.Pause(r.Context(), id, sandbox.PauseOptions{KeepMemory: keep}); err != nil {
		writeOrchError(w, r, err)
		return
	}
	w.WriteHeader(http.StatusNoContent)
}

// sandboxBody is the Sandbox schema (create, connect, resume).
func (s *Server) sandboxBody(sb *orchestrator.Sandbox) api.Sandbox {
	out := api.Sandbox{
		SandboxID:   sb.ID,
		TemplateID:  sb.TemplateID,
		ClientID:    "",
		EnvdVersion: sb.EnvdVersion,
		Domain:      s.domain(),
	}
	if sb.EnvdAccessToken != "" {
		tok := sb.EnvdAccessToken
		out.EnvdAccessToken = &tok
	}
	// E2B reports trafficAccessToken only for private sandboxes (null for public ones).
	if sb.Private && sb.TrafficAccessToken != "" {
		tok := sb.TrafficAccessToken
		out.TrafficAccessToken = &tok
	}
	if sb.Alias != "" {
		a := sb.Alias
		out.Alias = &a
	}
	return out
}

// listedBody is the ListedSandbox schema.
func listedBody(sb *orchestrator.Sandbox) api.ListedSandbox {
	out := api.ListedSandbox{
		SandboxID:   sb.ID,
		TemplateID:  sb.TemplateID,
		ClientID:    "",
		StartedAt:   sb.StartedAt.UTC(),
		EndAt:       sb.EndAt.UTC(),
		CpuCount:    int32(sb.Resources.CPUCount),
		MemoryMB:    int32(sb.Resources.MemoryMB),
		DiskSizeMB:  int32(sb.Resources.DiskSizeMB),
		EnvdVersion: sb.EnvdVersion,
		State:       api.SandboxState(sb.State.Public()),
	}
	if sb.Alias != "" {
		a := sb.Alias
		out.Alias = &a
	}
	if len(sb.Metadata) > 0 {
		md := api.SandboxMetadata(sb.Metadata)
		out.Metadata = &md
	}
	if len(sb.VolumeMounts) > 0 {
		out.VolumeMounts = volumeMountsBody(sb.VolumeMounts)
	}
	return out
}

// detailBody is the SandboxDetail schema (GET /sandboxes/{id}).
func (s *Server) detailBody(sb *orchestrator.Sandbox) api.SandboxDetail {
	l := listedBody(sb)
	allow := sb.AllowInternet
	onTimeout := api.Kill
	if sb.AutoPause {
		onTimeout = api.Pause
	}
	out := api.SandboxDetail{
		SandboxID: l.SandboxID, TemplateID: l.TemplateID, ClientID: l.ClientID, Alias: l.Alias,
		StartedAt: l.StartedAt, EndAt: l.EndAt, CpuCount: l.CpuCount, MemoryMB: l.MemoryMB,
		DiskSizeMB: l.DiskSizeMB, EnvdVersion: l.EnvdVersion, State: l.State, Metadata: l.Metadata,
		Domain:              s.domain(),
		AllowInternetAccess: &allow,
		Network:             networkBody(sb),
		Lifecycle:           &api.SandboxLifecycle{AutoResume: sb.AutoResume, OnTimeout: onTimeout},
		VolumeMounts:        l.VolumeMounts,
	}
	if sb.EnvdAccessToken != "" {
		tok := sb.EnvdAccessToken
		out.EnvdAccessToken = &tok
	}
	return out
}
