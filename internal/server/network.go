package server

import (
	"context"
	"fmt"
	"maps"
	"net/http"
	"strconv"
	"strings"

	"golang.org/x/net/http/httpguts"

	"github.com/aenv-dev/aenv/internal/orchestrator"
	"github.com/aenv-dev/aenv/internal/sandbox"
	"github.com/aenv-dev/aenv/internal/server/api"
)

// networkUpdater is implemented by orchestrators that can change a sandbox's outbound
// rules (PUT /sandboxes/{id}/network); others answer 501.
type networkUpdater interface {
	UpdateNetwork(ctx context.Context, id string, u orchestrator.NetworkUpdate) error
}

// createEgress validates the destination rules of a create's network config.
func createEgress(n *api.SandboxNetworkConfig) (orchestrator.Egress, error) {
	if n == nil {
		return orchestrator.Egress{}, nil
	}
	return parseEgress(n.EgressProxy, n.Rules, n.AllowOut, n.DenyOut)
}

// parseEgress validates a network config's destination rules (of a create or an update).
func parseEgress(proxy *api.SandboxEgressProxyConfig, rules *api.SandboxNetworkRules, allowOut, denyOut *[]string) (orchestrator.Egress, error) {
	var p *sandbox.SOCKSProxy
	if proxy != nil {
		p = &sandbox.SOCKSProxy{Address: proxy.Address, Username: deref(proxy.Username), Password: deref(proxy.Password)}
	}
	var rs map[string][]sandbox.Transform
	if rules != nil {
		rs = make(map[string][]sandbox.Transform, len(*rules))
		for k, list := range *rules {
			ts := make([]sandbox.Transform, len(list))
			for i, r := range list {
				if r.Transform != nil && r.Transform.Headers != nil {
					ts[i].Headers = *r.Transform.Headers
				}
			}
			rs[k] = ts
		}
	}
	return orchestrator.ParseEgress(derefList(allowOut), derefList(denyOut), rs, p)
}

// parseMaskRequestHost validates network.maskRequestHost: a Host header value once
// ${PORT} is replaced. Empty means none.
func parseMaskRequestHost(n *api.SandboxNetworkConfig) (string, error) {
	if n == nil || n.MaskRequestHost == nil || *n.MaskRequestHost == "" {
		return "", nil
	}
	m := *n.MaskRequestHost
	if len(m) > 255 || strings.TrimSpace(m) != m || !httpguts.ValidHostHeader(maskedHost(m, 65535)) || strings.ContainsAny(m, "/?#@") {
		return "", fmt.Errorf("network.maskRequestHost %q is not a host[:port] (${PORT} stands for the port)", m)
	}
	return m, nil
}

// maskedHost is the Host a request to port carries into a sandbox with mask.
func maskedHost(mask string, port int) string {
	return strings.ReplaceAll(mask, "${PORT}", strconv.Itoa(port))
}

func derefList(p *[]string) []string {
	if p == nil {
		return nil
	}
	return *p
}

func (h *handlers) UpdateSandboxNetwork(w http.ResponseWriter, r *http.Request, id api.SandboxID) {
	upd, ok := h.s.orch.(networkUpdater)
	if !ok {
		writeError(w, http.StatusNotImplemented, "this node cannot update network rules")
		return
	}
	var body api.SandboxNetworkUpdateConfig
	if !decodeRequired(w, r, &body) {
		return
	}
	eg, err := parseEgress(body.EgressProxy, body.Rules, body.AllowOut, body.DenyOut)
	if err != nil {
		writeError(w, http.StatusBadRequest, "%s", err.Error())
		return
	}
	u := orchestrator.NetworkUpdate{
		// E2B replaces the whole policy: an omitted allow_internet_access is cleared to true.
		AllowInternet: body.AllowInternetAccess == nil || *body.AllowInternetAccess,
		Egress:        eg,
	}
	if err := upd.UpdateNetwork(r.Context(), id, u); err != nil {
		writeOrchError(w, r, err)
		return
	}
	w.WriteHeader(http.StatusNoContent)
}

// networkBody is SandboxDetail.network: what the sandbox enforces.
func networkBody(sb *orchestrator.Sandbox) *api.SandboxNetworkConfig {
	public := !sb.Private
	out := &api.SandboxNetworkConfig{AllowPublicTraffic: &public}
	if len(sb.Egress.AllowOut) > 0 {
		a := append([]string(nil), sb.Egress.AllowOut...)
		out.AllowOut = &a
	}
	if len(sb.Egress.DenyOut) > 0 {
		d := append([]string(nil), sb.Egress.DenyOut...)
		out.DenyOut = &d
	}
	if len(sb.Egress.Rules) > 0 {
		rs := make(api.SandboxNetworkRules, len(sb.Egress.Rules))
		for k, list := range sb.Egress.Rules {
			rl := make([]api.SandboxNetworkRule, len(list))
			for i, t := range list {
				h := maps.Clone(t.Headers)
				if h == nil {
					h = map[string]string{}
				}
				rl[i].Transform = &api.SandboxNetworkTransform{Headers: &h}
			}
			rs[k] = rl
		}
		out.Rules = &rs
	}
	if p := sb.Egress.Proxy; p != nil {
		// The password is never returned (E2B's rule).
		out.EgressProxy = &api.SandboxEgressProxyConfig{Address: p.Address}
		if p.Username != "" {
			u := p.Username
			out.EgressProxy.Username = &u
		}
	}
	if sb.MaskRequestHost != "" {
		m := sb.MaskRequestHost
		out.MaskRequestHost = &m
	}
	return out
}
