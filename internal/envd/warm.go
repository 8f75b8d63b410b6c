package envd

import (
	"encoding/json"

	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/reflect/protoregistry"

	"github.com/aenv-dev/aenv/internal/envd/gen/process"
)

// Warm does ahead of the first command the lazy initialisation that command would do:
// protobuf builds each message type's coding tables on its first use, and encoding/json
// a struct's field cache on its first decode. A sandbox's first command paid for both
// (Process.Start's messages and /init's body: ~1 ms of CPU per sandbox on a 2-vCPU host,
// a sixth of envd's share of a create under a burst of 16). A warm container's envd runs
// Warm while it waits to be claimed, off the create's path. Only the messages a command
// needs are warmed (those Start's request and stream reach): tables for messages that are
// never used would cost each idle sandbox memory for nothing.
func Warm() {
	warmStart()
	var req InitRequest
	_ = json.Unmarshal([]byte(`{"envVars":{"K":"v"},"accessToken":"t","timestamp":"2006-01-02T15:04:05Z","defaultUser":"u","defaultWorkdir":"/"}`), &req)
}

// warmStart builds the coding tables of the messages Process.Start's request and stream
// reach and returns their names.
func warmStart() map[protoreflect.FullName]bool {
	seen := map[protoreflect.FullName]bool{}
	for _, m := range []proto.Message{&process.StartRequest{}, &process.StartResponse{}} {
		warmMessage(m.ProtoReflect().Descriptor(), seen)
	}
	return seen
}

// warmMessage builds the coding tables of md and of the messages its fields hold (map
// entries are not message types of their own), recording each in seen.
func warmMessage(md protoreflect.MessageDescriptor, seen map[protoreflect.FullName]bool) {
	if seen[md.FullName()] {
		return
	}
	seen[md.FullName()] = true
	if !md.IsMapEntry() {
		if mt, err := protoregistry.GlobalTypes.FindMessageByName(md.FullName()); err == nil {
			m := mt.New().Interface()
			_ = proto.Unmarshal(nil, m)
			_ = proto.Size(m)
		}
	}
	fs := md.Fields()
	for i := range fs.Len() {
		if f := fs.Get(i); f.Message() != nil {
			warmMessage(f.Message(), seen)
		}
	}
}
