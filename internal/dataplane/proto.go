package dataplane

import (
	"time"

	"github.com/aenv-dev/aenv/internal/storage/stack"
	"github.com/aenv-dev/aenv/internal/storage/zfile"
)

// The socket API: newline-delimited JSON, one request and one response at a time per
// connection. Every connection starts with a hello carrying the client's APIVersion; the
// server answers with its own and refuses a client of another major version. Operations
// added later within a major version are answered "unknown op" by older servers, which a
// newer client treats as "not supported here" (a node upgraded while an older data plane
// keeps serving its disks). A snapshot takes several requests on one connection; if the
// connection ends in the middle, the server ends the snapshot (see Snapshot).
//
// APIVersion is the major version of the socket API.
const APIVersion = 1

// Operations.
const (
	opHello      = "hello"
	opOpen       = "open"
	opList       = "list"
	opClose      = "close"
	opDropSyncs  = "dropsyncs"
	opStats      = "stats"
	opShutdown   = "shutdown"
	opSnapBegin  = "snap.begin"
	opSnapQuiet  = "snap.quiet"
	opSnapSeal   = "snap.seal"
	opSnapFinish = "snap.finish"
)

// Error codes of a response.
const (
	codeNotFound = "not_found"
	codeVersion  = "version"
	codeBusy     = "busy"
	codeUnknown  = "unknown_op"
	codeBroken   = "broken" // stack.ErrBroken
	codeInUse    = "in_use" // blockdev.ErrStillInUse
)

type request struct {
	Op      string `json:"op"`
	Version int    `json:"version,omitempty"`
	Spec    *Spec  `json:"spec,omitempty"`
	Dir     string `json:"dir,omitempty"`
	Output  string `json:"output,omitempty"`
}

type response struct {
	Error   string           `json:"error,omitempty"`
	Code    string           `json:"code,omitempty"`
	Version int              `json:"version,omitempty"`
	Build   string           `json:"build,omitempty"`
	Info    *Info            `json:"info,omitempty"`
	Disks   []Info           `json:"disks,omitempty"`
	Ref     *stack.LayerRef  `json:"ref,omitempty"`
	Lowers  []stack.LayerRef `json:"lowers,omitempty"`
	Durable time.Duration    `json:"durable,omitempty"`
	Stats   *Stats           `json:"stats,omitempty"`
}

// Info describes one disk the data plane serves.
type Info struct {
	Dir    string           `json:"dir"`
	Path   string           `json:"path"`
	Size   int64            `json:"size"`
	Lowers []stack.LayerRef `json:"lowers"`
	Opened time.Time        `json:"opened"`
}

// Stats describes the data plane process.
type Stats struct {
	PID        int       `json:"pid"`
	APIVersion int       `json:"apiVersion"`
	Build      string    `json:"build"`
	Started    time.Time `json:"started"`
	Disks      int       `json:"disks"`
	// RSSBytes is the process's resident memory (VmRSS).
	RSSBytes int64 `json:"rssBytes"`
	// Layers is how many distinct lower layers are open: disks on the same layers share
	// them (an older data plane leaves it 0).
	Layers int `json:"layers,omitempty"`
	// BlockCache counts the decompressed blocks of compressed lowers kept for all disks
	// (see zfile.BlockCache; an older data plane leaves it zero).
	BlockCache zfile.BlockCacheStats `json:"blockCache"`
	// CPU is the process's user plus system CPU time since it started.
	CPU time.Duration `json:"cpu"`
}
