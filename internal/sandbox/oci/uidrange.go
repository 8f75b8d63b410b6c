package oci

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"sort"
	"strings"

	"golang.org/x/sys/unix"
)

// DefaultUIDRangeFile is the host-wide record of which host uids each node hands to its
// sandboxes. It lives on /run: sandboxes do not survive a reboot, and neither need their
// ranges.
const DefaultUIDRangeFile = "/run/aenv/uid-ranges.json"

// uidFloor is the lowest host uid handed to sandboxes: below it are the host's own
// accounts (and /etc/subuid's customary first range starts here).
const uidFloor = 100000

// uidReservation is one node's block of host uids: Ranges ranges of idRangeSize ids from
// Base, one per network slot index.
type uidReservation struct {
	// Owner is the node's backend data directory (one node per directory: the node locks
	// it), so a restarted node finds its own block again.
	Owner  string `json:"owner"`
	Base   uint32 `json:"base"`
	Ranges uint32 `json:"ranges"`
}

func (r uidReservation) end() uint64 { return uint64(r.Base) + uint64(r.Ranges)*idRangeSize }

func (r uidReservation) overlaps(o uidReservation) bool {
	return uint64(r.Base) < o.end() && uint64(o.Base) < r.end()
}

func (r uidReservation) String() string {
	return fmt.Sprintf("%d-%d", r.Base, r.end()-1)
}

// reserveUIDs records the block of host uids of the node whose backend data directory is
// owner in the host-wide file path, under flock, so that two nodes on one host never hand
// the same host uid to sandboxes. base 0 picks the lowest free block (the node's earlier
// one when it is still free); a configured base that overlaps another node's block is an
// error naming both. Blocks of nodes whose data directory no longer exists are dropped.
func reserveUIDs(path, owner string, base uint32, ranges int) (uint32, error) {
	if ranges < 1 {
		return 0, fmt.Errorf("oci: uid ranges must be at least 1, got %d", ranges)
	}
	want := uidReservation{Owner: owner, Base: base, Ranges: uint32(ranges)}
	if base != 0 && base < uidFloor {
		return 0, fmt.Errorf("oci: uid base %d is below %d, where the host's own accounts are", base, uidFloor)
	}
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return 0, fmt.Errorf("oci: uid range file: %w", err)
	}
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE, 0o644)
	if err != nil {
		return 0, fmt.Errorf("oci: uid range file: %w", err)
	}
	defer f.Close()
	if err := unix.Flock(int(f.Fd()), unix.LOCK_EX); err != nil {
		return 0, fmt.Errorf("oci: lock %s: %w", path, err)
	}
	raw, err := io.ReadAll(f)
	if err != nil {
		return 0, fmt.Errorf("oci: read %s: %w", path, err)
	}
	var all []uidReservation
	if len(strings.TrimSpace(string(raw))) > 0 {
		if err := json.Unmarshal(raw, &all); err != nil {
			return 0, fmt.Errorf("oci: %s is not a uid range record (%v); remove it while no aenv node runs", path, err)
		}
	}
	var others []uidReservation
	var prev *uidReservation
	for _, r := range all {
		switch {
		case r.Owner == owner:
			prev = &r
		case ownerGone(r.Owner):
		default:
			others = append(others, r)
		}
	}
	sort.Slice(others, func(i, j int) bool { return others[i].Base < others[j].Base })
	free := func(c uidReservation) error {
		if c.end() > 1<<32 {
			return fmt.Errorf("oci: uid range %d + %d × %d ids passes the largest uid", c.Base, c.Ranges, idRangeSize)
		}
		for _, o := range others {
			if c.overlaps(o) {
				return fmt.Errorf("oci: uid range %s overlaps %s, the range of the node with data directory %s; "+
					"give each node on a host its own backend.uid_base (or 0: chosen automatically)", c, o, o.Owner)
			}
		}
		return nil
	}
	switch {
	case base != 0:
		if err := free(want); err != nil {
			return 0, err
		}
	case prev != nil && prev.Ranges == want.Ranges && free(*prev) == nil:
		want.Base = prev.Base
	default:
		want.Base = uidFloor
		for _, o := range others {
			if want.overlaps(o) {
				want.Base = uint32(min(o.end(), 1<<32-1))
			}
		}
		if err := free(want); err != nil {
			return 0, fmt.Errorf("oci: no free block of %d uid ranges on this host (lower backend.uid_ranges): %w", ranges, err)
		}
	}
	out, err := json.MarshalIndent(append(others, want), "", "  ")
	if err != nil {
		return 0, err
	}
	if err := f.Truncate(0); err != nil {
		return 0, fmt.Errorf("oci: write %s: %w", path, err)
	}
	if _, err := f.WriteAt(append(out, '\n'), 0); err != nil {
		return 0, fmt.Errorf("oci: write %s: %w", path, err)
	}
	return want.Base, f.Sync()
}

// ownerGone reports whether a reservation's node data directory no longer exists.
func ownerGone(dir string) bool {
	_, err := os.Stat(dir)
	return errors.Is(err, os.ErrNotExist)
}
