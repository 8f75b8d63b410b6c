package repository

import (
	"bytes"
	"encoding/json"
	"regexp"
	"time"
)

// Kind is the type of a record; each kind is its own namespace of ids.
type Kind string

const (
	KindTemplate Kind = "template" // built from an image (and build steps)
	KindSnapshot Kind = "snapshot" // captured from a sandbox
)

// Kinds lists every kind; GC scans all of them, so a kind that references
// blobs must be listed here or its blobs would be collected.
func Kinds() []Kind { return []Kind{KindTemplate, KindSnapshot} }

// Validate reports whether k is a known kind.
func (k Kind) Validate() error {
	for _, known := range Kinds() {
		if k == known {
			return nil
		}
	}
	return errorf(ErrInvalid, "record kind %q (want template or snapshot)", string(k))
}

// State is a record's publication state.
type State string

const (
	// StatePending: blobs may still be uploading; only the publishing node
	// may use the record, and GC already keeps every blob it names.
	StatePending State = "pending"
	// StateComplete: every blob is in the repository; any node may use it.
	StateComplete State = "complete"
)

// RecordVersion is the schema version this code writes; records with a
// higher version are rejected rather than misread.
const RecordVersion = 1

// maxRecordBytes bounds a record document: records are manifests, and a
// bound keeps a corrupt or hostile file from exhausting memory.
const maxRecordBytes = 1 << 20

// idPattern: ids appear in file and object names and URL paths, so no
// separators, no leading dot, bounded length. It matches the catalog's rule.
var idPattern = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$`)

// ValidateID reports whether id can name a record.
func ValidateID(id string) error {
	if !idPattern.MatchString(id) {
		return errorf(ErrInvalid, "record id %q must match %s", id, idPattern)
	}
	return nil
}

// Layer is one blob a record references.
type Layer struct {
	// Role says what the blob is for: "rootfs" (a sealed LSMT/ZFile layer,
	// listed bottom-up), "memory", "vmstate", "drive/<id>", ...
	Role   string `json:"role"`
	Digest Digest `json:"digest"`
	Size   int64  `json:"size"`
	// UUID is the LSMT layer's uuid, when it has one (stacks check parents).
	UUID string `json:"uuid,omitempty"`
	// BlockHashes names the blob's block hash list (see BlockHashes), so
	// lazy readers can verify each range they fetch. Records published
	// before lists existed have none; their layers are read unverified.
	BlockHashes Digest `json:"block_hashes,omitempty"`
}

// Resources are the sandbox defaults a template or snapshot carries.
type Resources struct {
	CPUCount   int `json:"cpu_count,omitempty"`
	MemoryMB   int `json:"memory_mb,omitempty"`
	DiskSizeMB int `json:"disk_size_mb,omitempty"`
}

// Record is a template or snapshot manifest (snake_case JSON, as the
// reference's committed snapshot records).
type Record struct {
	Version int    `json:"version"`
	Kind    Kind   `json:"kind"`
	ID      string `json:"id"`
	// Name is an optional human alias.
	Name  string `json:"name,omitempty"`
	State State  `json:"state"`
	// Revision counts publications of this record; see Repository.PutRecord.
	Revision  int64     `json:"revision"`
	Layers    []Layer   `json:"layers,omitempty"`
	Resources Resources `json:"resources"`
	// Config is owned by the snapshot/template layer (env vars, start and
	// ready commands, user, workdir, backend-specific state); stored verbatim.
	Config           json.RawMessage `json:"config,omitempty"`
	EnvdVersion      string          `json:"envd_version,omitempty"`
	Backend          string          `json:"backend,omitempty"`
	SourceSandboxID  string          `json:"source_sandbox_id,omitempty"`
	ParentSnapshotID string          `json:"parent_snapshot_id,omitempty"`
	CreatedAt        time.Time       `json:"created_at"`
	UpdatedAt        time.Time       `json:"updated_at"`
}

// Digests lists the blobs the record references.
func (r Record) Digests() []Digest {
	out := make([]Digest, 0, len(r.Layers))
	for _, l := range r.Layers {
		out = append(out, l.Digest)
	}
	return out
}

// BlobDigests lists every blob the record keeps from GC: its layers and
// their block hash lists.
func (r Record) BlobDigests() []Digest {
	out := r.Digests()
	for _, l := range r.Layers {
		if l.BlockHashes != "" {
			out = append(out, l.BlockHashes)
		}
	}
	return out
}

// Validate checks every field a consumer relies on.
func (r Record) Validate() error {
	if r.Version < 1 || r.Version > RecordVersion {
		return errorf(ErrInvalid, "record version %d (this build reads 1..%d)", r.Version, RecordVersion)
	}
	if err := r.Kind.Validate(); err != nil {
		return err
	}
	if err := ValidateID(r.ID); err != nil {
		return err
	}
	if r.Name != "" {
		if err := ValidateID(r.Name); err != nil {
			return errorf(ErrInvalid, "record %s name: %v", r.ID, err)
		}
	}
	if r.State != StatePending && r.State != StateComplete {
		return errorf(ErrInvalid, "record %s state %q (want pending or complete)", r.ID, string(r.State))
	}
	if r.Revision < 0 {
		return errorf(ErrInvalid, "record %s revision %d", r.ID, r.Revision)
	}
	for i, l := range r.Layers {
		if err := l.Digest.Validate(); err != nil {
			return errorf(ErrInvalid, "record %s layer %d: %v", r.ID, i, err)
		}
		if l.BlockHashes != "" {
			if err := l.BlockHashes.Validate(); err != nil {
				return errorf(ErrInvalid, "record %s layer %d block hashes: %v", r.ID, i, err)
			}
		}
		if l.Size < 0 {
			return errorf(ErrInvalid, "record %s layer %d size %d", r.ID, i, l.Size)
		}
		if l.Role == "" || len(l.Role) > 64 {
			return errorf(ErrInvalid, "record %s layer %d role %q", r.ID, i, l.Role)
		}
	}
	res := r.Resources
	if res.CPUCount < 0 || res.MemoryMB < 0 || res.DiskSizeMB < 0 {
		return errorf(ErrInvalid, "record %s has negative resources", r.ID)
	}
	for _, ref := range []struct{ what, v string }{{"source sandbox", r.SourceSandboxID}, {"parent snapshot", r.ParentSnapshotID}} {
		if ref.v != "" {
			if err := ValidateID(ref.v); err != nil {
				return errorf(ErrInvalid, "record %s %s: %v", r.ID, ref.what, err)
			}
		}
	}
	if len(r.Config) > 0 && !json.Valid(r.Config) {
		return errorf(ErrInvalid, "record %s config is not JSON", r.ID)
	}
	return nil
}

// DecodeRecord parses and validates a stored record. Unknown fields are
// ignored so that older nodes can read records written by newer ones of the
// same version.
func DecodeRecord(b []byte) (Record, error) {
	var r Record
	if len(b) > maxRecordBytes {
		return r, errorf(ErrInvalid, "record of %d bytes exceeds %d", len(b), maxRecordBytes)
	}
	dec := json.NewDecoder(bytes.NewReader(b))
	if err := dec.Decode(&r); err != nil {
		return Record{}, errorf(ErrInvalid, "record: %v", err)
	}
	if dec.More() {
		return Record{}, errorf(ErrInvalid, "record: trailing data")
	}
	if err := r.Validate(); err != nil {
		return Record{}, err
	}
	return r, nil
}

// EncodeRecord validates and serializes rec (indented: records are small and
// people read them when debugging a shared repository).
func EncodeRecord(rec Record) ([]byte, error) {
	if err := rec.Validate(); err != nil {
		return nil, err
	}
	b, err := json.MarshalIndent(rec, "", "  ")
	if err != nil {
		return nil, errorf(ErrInvalid, "record %s: %v", rec.ID, err)
	}
	return append(b, '\n'), nil
}

// PrepareRecord is the shared part of PutRecord: it validates rec against
// the stored record (nil when none) and returns the record to store.
func PrepareRecord(rec Record, stored *Record, now time.Time) (Record, error) {
	if rec.Version == 0 {
		rec.Version = RecordVersion
	}
	if err := rec.Validate(); err != nil {
		return Record{}, err
	}
	switch {
	case rec.Revision == 0 && stored != nil:
		return Record{}, errorf(ErrExists, "%s %s", rec.Kind, rec.ID)
	case rec.Revision != 0 && stored == nil:
		return Record{}, errorf(ErrNotFound, "%s %s (update of revision %d)", rec.Kind, rec.ID, rec.Revision)
	case stored != nil && stored.Revision != rec.Revision:
		return Record{}, errorf(ErrConflict, "%s %s: stored revision %d, update based on %d", rec.Kind, rec.ID, stored.Revision, rec.Revision)
	}
	now = now.UTC().Truncate(time.Millisecond)
	if stored != nil {
		rec.CreatedAt = stored.CreatedAt
	} else if rec.CreatedAt.IsZero() {
		rec.CreatedAt = now
	}
	rec.UpdatedAt = now
	rec.Revision++
	return rec, nil
}

// FilterIDs applies list options to ids sorted ascending; it returns the page
// of ids and the Next token.
func FilterIDs(sorted []string, o ListOptions) ([]string, string) {
	var out []string
	for _, id := range sorted {
		if o.Prefix != "" && !hasPrefix(id, o.Prefix) {
			continue
		}
		if o.After != "" && id <= o.After {
			continue
		}
		if len(out) == o.Limit {
			return out, out[len(out)-1]
		}
		out = append(out, id)
	}
	return out, ""
}

func hasPrefix(s, p string) bool { return len(s) >= len(p) && s[:len(p)] == p }
