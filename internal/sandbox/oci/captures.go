package oci

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
)

// ReconcileCaptures drops the capture records under DataDir/captures that no artifact in
// referenced names, then every layer file nothing uses any more. A node killed between
// a capture and its registration (a snapshot, a fork's fan-out, a pause to disk) leaves
// such records, and nothing else would ever discard them. referenced holds every artifact
// the orchestrator still keeps (catalog entries, disk-paused and paused records); a
// capture counts as named when any object in them has its id and a "layers" list. An
// artifact that is not JSON keeps every record (it might name any). Call it before the
// node serves requests: a capture taken meanwhile is not yet referenced.
func (b *Backend) ReconcileCaptures(_ context.Context, referenced []json.RawMessage) error {
	keep := map[string]bool{}
	for _, raw := range referenced {
		if len(raw) == 0 {
			continue
		}
		dec := json.NewDecoder(bytes.NewReader(raw))
		var v any
		if err := dec.Decode(&v); err != nil {
			return fmt.Errorf("oci: reconcile captures: an artifact is not JSON, keeping every capture: %w", err)
		}
		captureIDs(v, keep)
	}
	ents, err := os.ReadDir(b.capturesDir())
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("oci: reconcile captures: %w", err)
	}
	var errs []error
	b.layersMu.Lock()
	for _, e := range ents {
		id, ok := strings.CutSuffix(e.Name(), ".json")
		if !ok {
			// A record write the crash interrupted (<id>.json.tmp).
			if strings.HasSuffix(e.Name(), ".json.tmp") {
				errs = append(errs, removeIfExists(filepath.Join(b.capturesDir(), e.Name())))
			}
			continue
		}
		if keep[id] {
			continue
		}
		b.log.Info("oci: removing a capture nothing references (left by a crash)", "capture", id)
		errs = append(errs, removeIfExists(filepath.Join(b.capturesDir(), e.Name())))
	}
	b.layersMu.Unlock()
	errs = append(errs, b.gcLayers())
	return errors.Join(errs...)
}

// captureIDs adds to ids the "id" of every object in v that also has "layers".
func captureIDs(v any, ids map[string]bool) {
	switch x := v.(type) {
	case map[string]any:
		if id, ok := x["id"].(string); ok && idRE.MatchString(id) {
			if _, ok := x["layers"].([]any); ok {
				ids[id] = true
			}
		}
		for _, c := range x {
			captureIDs(c, ids)
		}
	case []any:
		for _, c := range x {
			captureIDs(c, ids)
		}
	}
}

func removeIfExists(path string) error {
	if err := os.Remove(path); err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("oci: %w", err)
	}
	return nil
}
