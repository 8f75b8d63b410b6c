package envd

import (
	"encoding/json"
	"testing"

	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"

	pb "github.com/aenv-dev/aenv/internal/envd/gen/process"
)

// The fast path must produce JSON that protojson reads back to the same message.
func TestJSONCodecFastPathRoundTrips(t *testing.T) {
	msgs := []proto.Message{
		&pb.StartResponse{Event: &pb.ProcessEvent{Event: &pb.ProcessEvent_Data{Data: &pb.ProcessEvent_DataEvent{Output: &pb.ProcessEvent_DataEvent_Stdout{Stdout: []byte("hi\n\x00\xff\"\\")}}}}},
		&pb.ConnectResponse{Event: &pb.ProcessEvent{Event: &pb.ProcessEvent_Data{Data: &pb.ProcessEvent_DataEvent{Output: &pb.ProcessEvent_DataEvent_Stderr{Stderr: []byte{}}}}}},
		&pb.StartResponse{Event: &pb.ProcessEvent{Event: &pb.ProcessEvent_Data{Data: &pb.ProcessEvent_DataEvent{Output: &pb.ProcessEvent_DataEvent_Pty{Pty: []byte("\x1b[0m")}}}}},
		&pb.StartResponse{Event: &pb.ProcessEvent{Event: &pb.ProcessEvent_End{End: &pb.ProcessEvent_EndEvent{ExitCode: -1, Status: "signal: killed"}}}},
		&pb.StartResponse{},
	}
	for _, m := range msgs {
		b, err := jsonCodec{}.Marshal(m)
		if err != nil {
			t.Fatal(err)
		}
		if !json.Valid(b) {
			t.Fatalf("invalid JSON %s", b)
		}
		got := m.ProtoReflect().New().Interface()
		if err := protojson.Unmarshal(b, got); err != nil {
			t.Fatalf("%s: %v", b, err)
		}
		if !proto.Equal(got, m) {
			t.Fatalf("%s: got %v want %v", b, got, m)
		}
	}
	if err := (jsonCodec{}).Unmarshal(nil, &pb.StartRequest{}); err == nil {
		t.Fatal("empty payload accepted")
	}
	var req pb.StartRequest
	if err := (jsonCodec{}).Unmarshal([]byte(`{"process":{"cmd":"x"},"unknownField":1}`), &req); err != nil || req.GetProcess().GetCmd() != "x" {
		t.Fatalf("%v %v", err, &req)
	}
}
