package mock

import (
	"context"
	"slices"

	"github.com/aenv-dev/aenv/internal/sandbox"
)

// egressRecord is what UpdateEgress was last given, and how often it was called.
type egressRecord struct {
	last  sandbox.Egress
	calls int
}

// UpdateEgress implements sandbox.EgressUpdater: it records the policy (StageEgress can
// fail it). A stopped instance reports ErrGone.
func (i *Instance) UpdateEgress(_ context.Context, e sandbox.Egress) error {
	if err := i.gone(); err != nil {
		return err
	}
	if err := i.b.check(StageEgress, i.id); err != nil {
		return err
	}
	i.mu.Lock()
	defer i.mu.Unlock()
	e.AllowOut, e.DenyOut, e.AllowDomains = slices.Clone(e.AllowOut), slices.Clone(e.DenyOut), slices.Clone(e.AllowDomains)
	i.egress.last = e
	i.egress.calls++
	return nil
}

// Egress is the policy last applied to the instance and how many times one was.
func (i *Instance) Egress() (sandbox.Egress, int) {
	i.mu.Lock()
	defer i.mu.Unlock()
	return i.egress.last, i.egress.calls
}
