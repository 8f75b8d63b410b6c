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
	if err := refuseProxyFields(n.EgressProxy, n.Rules); err != nil {
		return orchestrator.Egress{}, err
	}
	return orchestrator.ParseEgress(derefList(n.AllowOut), derefList(n.DenyOut))
}

func refuseProxyFields(proxy, rules *map[string]any) error {
	if proxy != nil && *proxy != nil {
		return fmt.Errorf("%w: network.egressProxy is not supported by this server", orchestrator.ErrInvalid)
	}
	if rules != nil && len(*rules) > 0 {
		return fmt.Errorf("%w: network.rules (request transforms) are not supported by this server", orchestrator.ErrInvalid)
	}
	return nil
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
	if err := refuseProxyFields(body.EgressProxy, body.Rules); err != nil {
		writeError(w, http.StatusBadRequest, "%s", err.Error())
		return
	}
	eg, err := orchestrator.ParseEgress(derefList(body.AllowOut), derefList(body.DenyOut))
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
