package orchestrator

import (
	"context"
	"errors"
	"fmt"

	"github.com/aenv-dev/aenv/internal/sandbox"
)

// Egress is a sandbox's destination rules (E2B's network.allowOut, denyOut, rules and
// egressProxy) in canonical form: CIDR strings and lowercase domain patterns. The
// slices and maps are replaced, never modified in place, so records may share them.
// The SOCKS5 password is kept in the record (the node's data directory) and never
// returned by the API.
type Egress struct {
	AllowOut []string                       `json:"allowOut,omitempty"`
	DenyOut  []string                       `json:"denyOut,omitempty"`
	Rules    map[string][]sandbox.Transform `json:"rules,omitempty"`
	Proxy    *sandbox.SOCKSProxy            `json:"egressProxy,omitempty"`
}

// Empty reports whether the rules restrict nothing.
func (g Egress) Empty() bool {
	return len(g.AllowOut) == 0 && len(g.DenyOut) == 0 && len(g.Rules) == 0 && g.Proxy == nil
}

// ParseEgress validates E2B allowOut (IP addresses, CIDR blocks, domain patterns),
// denyOut (IP addresses and CIDR blocks), rules and egressProxy, and returns them in
// canonical form. Errors wrap ErrInvalid.
func ParseEgress(allowOut, denyOut []string, rules map[string][]sandbox.Transform, proxy *sandbox.SOCKSProxy) (Egress, error) {
	allow, domains, err := sandbox.ParseAllowOut("network.allowOut", allowOut)
	if err != nil {
		return Egress{}, fmt.Errorf("%w: %w", ErrInvalid, err)
	}
	deny, err := sandbox.ParseDestinations("network.denyOut", denyOut)
	if err != nil {
		return Egress{}, fmt.Errorf("%w: %w", ErrInvalid, err)
	}
	out := Egress{}
	if out.Rules, err = sandbox.ParseRules(rules); err != nil {
		return Egress{}, fmt.Errorf("%w: %w", ErrInvalid, err)
	}
	if out.Proxy, err = sandbox.ParseSOCKSProxy(proxy); err != nil {
		return Egress{}, fmt.Errorf("%w: %w", ErrInvalid, err)
	}
	if len(allow)+len(domains) > 0 {
		out.AllowOut = append(sandbox.FormatDestinations(allow), domains...)
	}
	if len(deny) > 0 {
		out.DenyOut = sandbox.FormatDestinations(deny)
	}
	return out, nil
}

// policy is the record's outbound policy for the backend.
func (rec *Sandbox) policy() (sandbox.Egress, error) {
	allow, domains, err := sandbox.ParseAllowOut("allowOut", rec.Egress.AllowOut)
	if err != nil {
		return sandbox.Egress{}, err
	}
	deny, err := sandbox.ParseDestinations("denyOut", rec.Egress.DenyOut)
	if err != nil {
		return sandbox.Egress{}, err
	}
	return sandbox.Egress{
		AllowInternet: rec.AllowInternet, AllowOut: allow, DenyOut: deny,
		AllowDomains: domains, Rules: rec.Egress.Rules, Proxy: rec.Egress.Proxy,
	}, nil
}

// applyEgress installs rec's outbound policy on inst. Backends without EgressUpdater
// only know AllowInternet (from the launch plan), so destination rules on them are
// refused rather than silently not enforced.
func (o *Orchestrator) applyEgress(ctx context.Context, inst sandbox.Instance, rec *Sandbox) error {
	pol, err := rec.policy()
	if err != nil {
		return fmt.Errorf("egress rules of %s: %w", rec.ID, err)
	}
	// Secrets are resolved at egress: the backend's proxy gets the values, the record
	// keeps the placeholders.
	if pol.Rules, err = o.expandRules(rec.Owner, pol.Rules); err != nil {
		return err
	}
	upd, ok := inst.(sandbox.EgressUpdater)
	if !ok {
		if !rec.Egress.Empty() {
			return fmt.Errorf("%w: backend %s cannot enforce network.allowOut/denyOut/rules/egressProxy", ErrUnsupported, o.backend.Name())
		}
		return nil
	}
	if err := upd.UpdateEgress(ctx, pol); err != nil {
		return fmt.Errorf("egress rules of %s: %w", rec.ID, err)
	}
	return nil
}

// NetworkUpdate is PUT /sandboxes/{id}/network: it replaces the whole outbound policy
// (E2B: omitted fields are cleared, so allow_internet_access defaults to true).
type NetworkUpdate struct {
	AllowInternet bool
	Egress        Egress
}

// UpdateNetwork replaces a sandbox's outbound policy. A running sandbox, or one paused in
// place, gets it at once; one paused without a live instance gets it when it resumes.
// The record is updated only once the rules are in place; on failure the old policy
// stays. Errors: ErrNotFound, ErrInvalid, ErrUnsupported.
func (o *Orchestrator) UpdateNetwork(ctx context.Context, id string, u NetworkUpdate) error {
	if _, err := ParseEgress(u.Egress.AllowOut, u.Egress.DenyOut, u.Egress.Rules, u.Egress.Proxy); err != nil {
		return err
	}
	e, _, err := o.acquire(ctx, id, waitOpts{})
	if err != nil {
		return err
	}
	inst, old := e.inst, e.clone()
	p, prev := o.begin(e, e.rec.State)
	octx, cancel := o.opContext(ctx)
	defer cancel()

	next := *old
	next.AllowInternet, next.Egress = u.AllowInternet, u.Egress
	if inst != nil {
		if _, ok := inst.(sandbox.EgressUpdater); !ok && next.AllowInternet != old.AllowInternet {
			err := fmt.Errorf("%w: backend %s cannot change internet access of a live sandbox", ErrUnsupported, o.backend.Name())
			o.finish(e, p, prev, err)
			return err
		}
		// A backend whose pause stops the instance leaves a gone one while paused: the
		// rules then go in at resume, like for a sandbox without an instance.
		if err := o.applyEgress(octx, inst, &next); err != nil && !(prev == StatePaused && errors.Is(err, sandbox.ErrGone)) {
			o.finish(e, p, prev, err)
			return err
		}
		// New rules need the CA for HTTPS; processes already running (and Node.js ones,
		// whose NODE_EXTRA_CA_CERTS was not set at create) may not see it.
		if prev == StateRunning && o.wantsEgressCA(&next) {
			if err := o.installEgressCA(octx, inst.Endpoint(), &next); err != nil {
				o.log.Warn("install the egress CA", "sandbox", id, "err", err)
			}
		}
	}
	o.mu.Lock()
	e.rec.AllowInternet, e.rec.Egress = next.AllowInternet, next.Egress
	o.mu.Unlock()
	if err := o.persist(e); err != nil {
		o.mu.Lock()
		e.rec.AllowInternet, e.rec.Egress = old.AllowInternet, old.Egress
		o.mu.Unlock()
		if inst != nil {
			if rerr := o.applyEgress(octx, inst, old); rerr != nil {
				err = errors.Join(err, fmt.Errorf("restore previous network rules: %w", rerr))
			}
		}
		o.finish(e, p, prev, err)
		return err
	}
	o.logEvent(id, LevelInfo, "network rules updated", map[string]string{
		"allowInternetAccess": fmt.Sprint(next.AllowInternet),
		"allowOut":            fmt.Sprint(next.Egress.AllowOut),
		"denyOut":             fmt.Sprint(next.Egress.DenyOut),
		"rules":               fmt.Sprint(sandbox.RuleKeys(next.Egress.Rules)),
		"egressProxy":         proxyAddress(next.Egress.Proxy),
	})
	o.finish(e, p, prev, nil)
	return nil
}

// reapplyEgress re-installs the policy of a sandbox adopted after a restart: the node
// re-creates its nftables tables at start, so destination rules are gone and the
// internet setting is the one recorded at launch.
func (o *Orchestrator) reapplyEgress(ctx context.Context, e *entry) {
	if e.inst == nil {
		return
	}
	if err := o.applyEgress(ctx, e.inst, &e.rec); err != nil {
		o.log.Error("re-apply network rules after restart", "sandbox", e.rec.ID, "err", err)
	}
}

// proxyAddress is what logs say of a SOCKS5 proxy: its address, never its credentials.
func proxyAddress(p *sandbox.SOCKSProxy) string {
	if p == nil {
		return ""
	}
	return p.Address
}
