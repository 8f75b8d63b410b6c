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

// Automatic sizing (backend.uid_ranges 0): a node asks for one range per 4 MiB of host
// memory, about what an idle sandbox costs with its share of the host (docs/operations.md,
// "What caps a node"), so the uid block is never what stops a node before memory does;
// from 256 (small hosts and CI runners, where several nodes share the host's ids) to
// 16384 (2^30 ids: a quarter of the host's). When the host's free ids hold fewer, it takes
// the largest free block of at least minAutoUIDRanges.
const (
	autoUIDRangeBytes = 4 << 20
	minAutoUIDRanges  = 64
	maxAutoUIDRanges  = 16384
)

// autoUIDRanges is the automatic size of a node's block on a host with memBytes of memory.
func autoUIDRanges(memBytes uint64) int {
	return int(min(max(memBytes/autoUIDRangeBytes, 256), maxAutoUIDRanges))
}

// uidRequest is the block a node asks for.
type uidRequest struct {
	// Owner is the node's backend data directory (see uidReservation).
	Owner string
	// Base is the block's first uid; 0: the lowest free block that holds Ranges.
	Base uint32
	// Ranges is how many ranges the block holds; with Auto, how many it should.
	Ranges int
	// Auto sizes the block to the room there is: the node's earlier block again (grown
	// towards Ranges where the ids after it are free), else the lowest free block of
	// Ranges, else the largest free one of at least minAutoUIDRanges.
	Auto bool
}

// reserveUIDs records the block of host uids of the node req.Owner in the host-wide file
// path, under flock, so that two nodes on one host never hand the same host uid to
// sandboxes. Without a base it picks the lowest free block (the node's earlier one when
// it is still free: sandboxes that outlived the node keep their ids); a configured base
// that overlaps another node's block is an error naming both. Blocks of nodes whose data
// directory no longer exists are dropped.
func reserveUIDs(path string, req uidRequest) (uidReservation, error) {
	if req.Ranges < 1 {
		return uidReservation{}, fmt.Errorf("oci: uid ranges must be at least 1, got %d", req.Ranges)
	}
	if req.Base != 0 && req.Base < uidFloor {
		return uidReservation{}, fmt.Errorf("oci: uid base %d is below %d, where the host's own accounts are", req.Base, uidFloor)
	}
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return uidReservation{}, fmt.Errorf("oci: uid range file: %w", err)
	}
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE, 0o644)
	if err != nil {
		return uidReservation{}, fmt.Errorf("oci: uid range file: %w", err)
	}
	defer f.Close()
	if err := unix.Flock(int(f.Fd()), unix.LOCK_EX); err != nil {
		return uidReservation{}, fmt.Errorf("oci: lock %s: %w", path, err)
	}
	raw, err := io.ReadAll(f)
	if err != nil {
		return uidReservation{}, fmt.Errorf("oci: read %s: %w", path, err)
	}
	var all []uidReservation
	if len(strings.TrimSpace(string(raw))) > 0 {
		if err := json.Unmarshal(raw, &all); err != nil {
			return uidReservation{}, fmt.Errorf("oci: %s is not a uid range record (%v); remove it while no aenv node runs", path, err)
		}
	}
	var others []uidReservation
	var prev *uidReservation
	for _, r := range all {
		switch {
		case r.Owner == req.Owner:
			prev = &r
		case ownerGone(r.Owner):
		default:
			others = append(others, r)
		}
	}
	sort.Slice(others, func(i, j int) bool { return others[i].Base < others[j].Base })
	want, err := placeUIDs(req, prev, others)
	if err != nil {
		return uidReservation{}, err
	}
	out, err := json.MarshalIndent(append(others, want), "", "  ")
	if err != nil {
		return uidReservation{}, err
	}
	if err := f.Truncate(0); err != nil {
		return uidReservation{}, fmt.Errorf("oci: write %s: %w", path, err)
	}
	if _, err := f.WriteAt(append(out, '\n'), 0); err != nil {
		return uidReservation{}, fmt.Errorf("oci: write %s: %w", path, err)
	}
	return want, f.Sync()
}

// placeUIDs chooses the node's block among the other nodes' (sorted by base), given its
// earlier one (nil: none).
func placeUIDs(req uidRequest, prev *uidReservation, others []uidReservation) (uidReservation, error) {
	want := uidReservation{Owner: req.Owner, Base: req.Base, Ranges: uint32(req.Ranges)}
	if req.Base != 0 {
		if want.end() > 1<<32 {
			return want, fmt.Errorf("oci: uid range %d + %d × %d ids passes the largest uid", want.Base, want.Ranges, idRangeSize)
		}
		for _, o := range others {
			if want.overlaps(o) {
				return want, fmt.Errorf("oci: uid range %s overlaps %s, the range of the node with data directory %s; "+
					"give each node on a host its own backend.uid_base (or 0: chosen automatically)", want, o, o.Owner)
			}
		}
		return want, nil
	}
	gaps := freeUIDs(others)
	if prev != nil && (req.Auto || prev.Ranges == want.Ranges) {
		for _, g := range gaps {
			if g.start <= uint64(prev.Base) && prev.end() <= g.end {
				if req.Auto {
					room := uint32((g.end - uint64(prev.Base)) / idRangeSize)
					want.Ranges = max(prev.Ranges, min(want.Ranges, room))
				}
				want.Base = prev.Base
				return want, nil
			}
		}
	}
	var largest uidGap
	for _, g := range gaps {
		if g.ranges() >= want.Ranges {
			want.Base = uint32(g.start)
			return want, nil
		}
		if g.ranges() > largest.ranges() {
			largest = g
		}
	}
	if req.Auto && largest.ranges() >= minAutoUIDRanges {
		want.Base, want.Ranges = uint32(largest.start), largest.ranges()
		return want, nil
	}
	hint := "lower backend.uid_ranges"
	if req.Auto {
		hint = "free the blocks of nodes that no longer run from " + DefaultUIDRangeFile + ", or set backend.uid_ranges"
	}
	return want, fmt.Errorf("oci: no free block of %d uid ranges on this host (the largest holds %d; %s)", want.Ranges, largest.ranges(), hint)
}

// uidGap is a run of host uids no node holds: [start, end).
type uidGap struct{ start, end uint64 }

func (g uidGap) ranges() uint32 { return uint32((g.end - g.start) / idRangeSize) }

// freeUIDs lists the runs between uidFloor and the largest uid that no reservation in
// others (sorted by base) holds, lowest first.
func freeUIDs(others []uidReservation) []uidGap {
	var gaps []uidGap
	next := uint64(uidFloor)
	for _, o := range others {
		if uint64(o.Base) > next {
			gaps = append(gaps, uidGap{next, uint64(o.Base)})
		}
		next = max(next, o.end())
	}
	if next < 1<<32 {
		gaps = append(gaps, uidGap{next, 1 << 32})
	}
	return gaps
}

// ownerGone reports whether a reservation's node data directory no longer exists.
func ownerGone(dir string) bool {
	_, err := os.Stat(dir)
	return errors.Is(err, os.ErrNotExist)
}
