package envd

import (
	"testing"

	"google.golang.org/protobuf/reflect/protoreflect"
)

// Warm reaches the messages of a command's request and stream, nested ones included, and
// no other.
func TestWarmReachesStartMessages(t *testing.T) {
	seen := warmStart()
	for _, want := range []protoreflect.FullName{"process.ProcessConfig", "process.PTY.Size", "process.ProcessEvent", "process.ProcessEvent.DataEvent", "process.ProcessEvent.EndEvent", "process.ProcessEvent.KeepAlive"} {
		if !seen[want] {
			t.Errorf("%s not warmed (warmed: %v)", want, seen)
		}
	}
	for _, not := range []protoreflect.FullName{"process.ListResponse", "process.SendInputRequest"} {
		if seen[not] {
			t.Errorf("%s warmed: a command does not use it", not)
		}
	}
	Warm()
}
