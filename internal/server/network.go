package server

import (
	"context"
	"fmt"
	"net/http"

	"github.com/aenv-dev/aenv/internal/orchestrator"
	"github.com/aenv-dev/aenv/internal/server/api"
)

// networkUpdater is implemented by orchestrators that can change a sandbox's outbound
// rules (PUT /sandboxes/{id}/network); others answer 501.
type networkUpdater interface {
	UpdateNetwork(ctx context.Context, id string, u orchestrator.NetworkUpdate) error
}

// createEgress validates the destination rules of a create's network config. Fields that
// would need an egress proxy (egressProxy, rules) are refused: accepting them would let a
// user believe traffic is tunnelled or rewritten when it is not.
func createEgress(n *api.SandboxNetworkConfig) (orchestrator.Egress, error) {
	if n == nil {
		return orchestrator.Egress{}, nil
	}
	return parseEgress(n.EgressProxy, n.Rules, n.AllowOut, n.DenyOut)
}

// parseEgress validates a network config's destination rules (of a create or an
// update), refusing the fields that would need an egress proxy.
func parseEgress(proxy, rules *map[string]any, allowOut, denyOut *[]string) (orchestrator.Egress, error) {
	if proxy != nil && *proxy != nil {
		return orchestrator.Egress{}, fmt.Errorf("%w: network.egressProxy is not supported by this server", orchestrator.ErrInvalid)
	}
	if rules != nil && len(*rules) > 0 {
		return orchestrator.Egress{}, fmt.Errorf("%w: network.rules (request transforms) are not supported by this server", orchestrator.ErrInvalid)
	}
	return orchestrator.ParseEgress(derefList(allowOut), derefList(denyOut))
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
	return out
}
