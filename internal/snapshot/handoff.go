package snapshot

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/aenv-dev/aenv/internal/catalog"
	"github.com/aenv-dev/aenv/internal/repository"
)

// A handoff is a sandbox paused to disk on one node of a cluster and published so that
// another node can resume it when the first is gone, full or draining: a snapshot record
// (the capture's layers and, for a microVM, its memory image) whose config also carries
// the sandbox's own record (id, tokens, metadata, environment, timeout settings). Its id
// is HandoffPrefix + sandbox id + "-" + the pause's time, so the newest handoff of a
// sandbox sorts last. Whoever resumes it first claims it by a compare-and-swap of the
// record's revision (config "claimed_by"): exactly one node ever resumes a handoff.

// HandoffPrefix begins the id of every handoff record. Sync leaves such records alone
// (they are not snapshots users made); only the node that claims one registers it.
const HandoffPrefix = "paused-"

// ErrClaimed: the sandbox's newest handoff was claimed by another node (it was resumed
// there), or is gone.
var ErrClaimed = errors.New("snapshot: the paused sandbox was resumed by another node")

// HandoffID names the handoff of sandboxID paused at at.
func HandoffID(sandboxID string, at time.Time) string {
	return fmt.Sprintf("%s%s-%013d", HandoffPrefix, sandboxID, at.UnixMilli())
}

// IsHandoff reports whether id names a handoff record (or its catalog entry).
func IsHandoff(id string) bool { return strings.HasPrefix(id, HandoffPrefix) }

// PublishHandoff publishes t, a snapshot of a paused sandbox as the orchestrator
// describes it (never put in this node's catalog), with the sandbox's record.
func (p *Publisher) PublishHandoff(ctx context.Context, t catalog.Template, envdVersion string, sandbox json.RawMessage) (*Handle, error) {
	if !IsHandoff(t.ID) {
		return nil, fmt.Errorf("%w: handoff id %q must begin with %s", ErrInvalid, t.ID, HandoffPrefix)
	}
	m, err := ManifestFromTemplate(t, envdVersion)
	if err != nil {
		return nil, err
	}
	m.Config.Sandbox = sandbox
	return p.Publish(ctx, m)
}

// ClaimHandoff claims the newest published handoff of sandboxID for owner (a node id)
// and registers it in this node's catalog, so the sandbox can be launched from it. It
// returns the catalog entry and the sandbox's record as published. No complete handoff:
// ErrNotFound; the newest one claimed by another node: ErrClaimed.
func (p *Publisher) ClaimHandoff(ctx context.Context, sandboxID, owner string) (catalog.Template, json.RawMessage, error) {
	page, err := p.repo.ListRecords(ctx, repository.KindSnapshot,
		repository.ListOptions{Prefix: HandoffPrefix + sandboxID + "-", Limit: repository.MaxListLimit})
	if err != nil {
		return catalog.Template{}, nil, fmt.Errorf("snapshot: list the handoffs of %s: %w", sandboxID, err)
	}
	var rec *repository.Record
	for i := len(page.Records) - 1; i >= 0; i-- {
		if page.Records[i].State == repository.StateComplete {
			rec = &page.Records[i]
			break
		}
	}
	if rec == nil {
		return catalog.Template{}, nil, fmt.Errorf("%w: no published handoff of sandbox %s", ErrNotFound, sandboxID)
	}
	cfg, err := p.claim(ctx, *rec, owner)
	if err != nil {
		return catalog.Template{}, nil, err
	}
	p.syncMu.Lock()
	defer p.syncMu.Unlock()
	stored, err := p.repo.GetRecord(ctx, rec.Kind, rec.ID)
	if err != nil {
		return catalog.Template{}, nil, fmt.Errorf("snapshot: read the claimed handoff %s: %w", rec.ID, err)
	}
	if err := p.register(ctx, stored, false); err != nil {
		return catalog.Template{}, nil, err
	}
	t, err := p.cat.Get(rec.ID)
	if err != nil {
		return catalog.Template{}, nil, err
	}
	return t, cfg.Sandbox, nil
}

// ClaimOwnHandoff claims handoff id for owner before the node that published it resumes
// the sandbox itself. ErrClaimed when another node claimed it first or it is gone (a
// node that resumed it killed the sandbox since).
func (p *Publisher) ClaimOwnHandoff(ctx context.Context, id, owner string) error {
	rec, err := p.repo.GetRecord(ctx, repository.KindSnapshot, id)
	if errors.Is(err, repository.ErrNotFound) {
		return fmt.Errorf("%w: handoff %s is gone", ErrClaimed, id)
	}
	if err != nil {
		return fmt.Errorf("snapshot: read handoff %s: %w", id, err)
	}
	_, err = p.claim(ctx, rec, owner)
	return err
}

// HandoffClaimedElsewhere reports whether handoff id was claimed by a node other than
// owner, or is gone.
func (p *Publisher) HandoffClaimedElsewhere(ctx context.Context, id, owner string) (bool, error) {
	rec, err := p.repo.GetRecord(ctx, repository.KindSnapshot, id)
	if errors.Is(err, repository.ErrNotFound) {
		return true, nil
	}
	if err != nil {
		return false, err
	}
	var cfg recordConfig
	if err := json.Unmarshal(rec.Config, &cfg); err != nil {
		return false, fmt.Errorf("%w: handoff %s config: %v", ErrInvalid, id, err)
	}
	return cfg.ClaimedBy != "" && cfg.ClaimedBy != owner, nil
}

// claim sets rec's claimed_by to owner with a compare-and-swap on its revision.
func (p *Publisher) claim(ctx context.Context, rec repository.Record, owner string) (recordConfig, error) {
	var cfg recordConfig
	if err := json.Unmarshal(rec.Config, &cfg); err != nil {
		return cfg, fmt.Errorf("%w: handoff %s config: %v", ErrInvalid, rec.ID, err)
	}
	switch cfg.ClaimedBy {
	case owner:
		return cfg, nil
	case "":
	default:
		return cfg, fmt.Errorf("%w: handoff %s was claimed by node %s", ErrClaimed, rec.ID, cfg.ClaimedBy)
	}
	cfg.ClaimedBy = owner
	raw, err := json.Marshal(cfg)
	if err != nil {
		return cfg, err
	}
	rec.Config = raw
	_, err = p.repo.PutRecord(ctx, rec)
	switch {
	case errors.Is(err, repository.ErrConflict), errors.Is(err, repository.ErrNotFound):
		return cfg, fmt.Errorf("%w: handoff %s changed under the claim: %v", ErrClaimed, rec.ID, err)
	case err != nil:
		return cfg, fmt.Errorf("snapshot: claim handoff %s: %w", rec.ID, err)
	}
	return cfg, nil
}

// ReleaseHandoff gives back owner's claim of handoff id (its resume failed), so another
// node, or this one, can claim it again.
func (p *Publisher) ReleaseHandoff(ctx context.Context, id, owner string) error {
	rec, err := p.repo.GetRecord(ctx, repository.KindSnapshot, id)
	if err != nil {
		return fmt.Errorf("snapshot: read handoff %s: %w", id, err)
	}
	var cfg recordConfig
	if err := json.Unmarshal(rec.Config, &cfg); err != nil {
		return fmt.Errorf("%w: handoff %s config: %v", ErrInvalid, id, err)
	}
	if cfg.ClaimedBy != owner {
		return nil
	}
	cfg.ClaimedBy = ""
	if rec.Config, err = json.Marshal(cfg); err != nil {
		return err
	}
	if _, err := p.repo.PutRecord(ctx, rec); err != nil {
		return fmt.Errorf("snapshot: release handoff %s: %w", id, err)
	}
	return nil
}
