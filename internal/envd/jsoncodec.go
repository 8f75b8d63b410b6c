package envd

import (
	"encoding/base64"
	"errors"
	"fmt"

	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"

	pb "github.com/aenv-dev/aenv/internal/envd/gen/process"
)

// jsonCodec is connect's "json" codec (protojson) with a fast path for process output events,
// which the SDKs receive as {"event":{"data":{"stdout":"<base64>"}}}. protojson checks every byte
// of the base64 text for characters to escape, which halves streaming throughput; base64 never
// needs escaping, so those events are written directly. Everything else is plain protojson.
type jsonCodec struct{}

func (jsonCodec) Name() string { return "json" }

func (jsonCodec) Marshal(m any) ([]byte, error) {
	return jsonCodec{}.MarshalAppend(nil, m)
}

func (jsonCodec) MarshalAppend(dst []byte, m any) ([]byte, error) {
	var ev *pb.ProcessEvent
	switch v := m.(type) {
	case *pb.StartResponse:
		ev = v.GetEvent()
	case *pb.ConnectResponse:
		ev = v.GetEvent()
	}
	if d := ev.GetData(); d != nil {
		var key string
		var data []byte
		switch o := d.GetOutput().(type) {
		case *pb.ProcessEvent_DataEvent_Stdout:
			key, data = "stdout", o.Stdout
		case *pb.ProcessEvent_DataEvent_Stderr:
			key, data = "stderr", o.Stderr
		case *pb.ProcessEvent_DataEvent_Pty:
			key, data = "pty", o.Pty
		}
		if key != "" {
			dst = append(dst, `{"event":{"data":{"`...)
			dst = append(dst, key...)
			dst = append(dst, `":"`...)
			dst = base64.StdEncoding.AppendEncode(dst, data)
			return append(dst, `"}}}`...), nil
		}
	}
	msg, ok := m.(proto.Message)
	if !ok {
		return nil, fmt.Errorf("%T is not a proto.Message", m)
	}
	return protojson.MarshalOptions{}.MarshalAppend(dst, msg)
}

func (jsonCodec) Unmarshal(b []byte, m any) error {
	msg, ok := m.(proto.Message)
	if !ok {
		return fmt.Errorf("%T is not a proto.Message", m)
	}
	if len(b) == 0 {
		return errors.New("zero-length payload is not a valid JSON object")
	}
	return protojson.UnmarshalOptions{DiscardUnknown: true}.Unmarshal(b, msg)
}
