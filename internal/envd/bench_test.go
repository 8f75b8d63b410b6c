package envd_test

import (
	"bytes"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"testing"

	"connectrpc.com/connect"

	pb "github.com/aenv-dev/aenv/internal/envd/gen/process"
	"github.com/aenv-dev/aenv/internal/envd/gen/process/processconnect"
)

// benchEnv is newEnv for benchmarks (same server over loopback TCP).
func benchEnv(b *testing.B) *env { return newEnvTB(b) }

func benchStart(b *testing.B, c processconnect.ProcessClient, cmd string, args ...string) (int64, *pb.ProcessEvent_EndEvent) {
	s, err := c.Start(b.Context(), connect.NewRequest(&pb.StartRequest{Process: &pb.ProcessConfig{Cmd: cmd, Args: args}, Stdin: ptr(false)}))
	if err != nil {
		b.Fatal(err)
	}
	var n int64
	var end *pb.ProcessEvent_EndEvent
	for s.Receive() {
		ev := s.Msg().GetEvent()
		n += int64(len(ev.GetData().GetStdout()))
		if ev.GetEnd() != nil {
			end = ev.GetEnd()
		}
	}
	if s.Err() != nil || end == nil {
		b.Fatal(s.Err())
	}
	return n, end
}

// Round trip of a command through a Go Connect client: start, output, end.
func BenchmarkRunTrue(b *testing.B) {
	e := benchEnv(b)
	for _, c := range []struct {
		name   string
		client processconnect.ProcessClient
		cmd    []string
	}{
		{"proto/true", e.proc, []string{"/bin/true"}},
		{"json/true", processconnect.NewProcessClient(e.httpClient(), e.url, connect.WithProtoJSON()), []string{"/bin/true"}},
		{"json/bash-l-c-true", processconnect.NewProcessClient(e.httpClient(), e.url, connect.WithProtoJSON()), []string{"/bin/bash", "-l", "-c", "true"}},
	} {
		b.Run(c.name, func(b *testing.B) {
			for b.Loop() {
				benchStart(b, c.client, c.cmd[0], c.cmd[1:]...)
			}
		})
	}
}

// Stdout streaming throughput (256 MiB of output per iteration).
func BenchmarkStdoutThroughput(b *testing.B) {
	e := benchEnv(b)
	const size = 256 << 20
	for _, c := range []struct {
		name   string
		client processconnect.ProcessClient
	}{
		{"proto", e.proc},
		{"json", processconnect.NewProcessClient(e.httpClient(), e.url, connect.WithProtoJSON())},
	} {
		b.Run(c.name, func(b *testing.B) {
			b.SetBytes(size)
			for b.Loop() {
				if n, _ := benchStart(b, c.client, "head", "-c", "268435456", "/dev/zero"); n != size {
					b.Fatalf("got %d bytes", n)
				}
			}
		})
	}
}

// 100 MB upload (raw and multipart) and download through /files.
func BenchmarkFiles100MB(b *testing.B) {
	e := benchEnv(b)
	const size = 100 << 20
	data := bytes.Repeat([]byte("0123456789abcdef"), size/16)
	client := &http.Client{Transport: &http.Transport{DisableCompression: true}}
	b.Run("upload-octet-stream", func(b *testing.B) {
		b.SetBytes(size)
		for b.Loop() {
			resp, err := client.Post(e.url+"/files?path=big.bin", "application/octet-stream", bytes.NewReader(data))
			if err != nil || resp.StatusCode != 200 {
				b.Fatal(err, resp.StatusCode)
			}
			resp.Body.Close()
		}
	})
	b.Run("upload-multipart", func(b *testing.B) {
		b.SetBytes(size)
		head := "--XyZ\r\nContent-Disposition: form-data; name=\"file\"; filename=\"big.bin\"\r\nContent-Type: application/octet-stream\r\n\r\n"
		tail := "\r\n--XyZ--\r\n"
		for b.Loop() {
			body := io.MultiReader(bytes.NewReader([]byte(head)), bytes.NewReader(data), bytes.NewReader([]byte(tail)))
			resp, err := client.Post(e.url+"/files?path=big.bin", "multipart/form-data; boundary=XyZ", body)
			if err != nil || resp.StatusCode != 200 {
				b.Fatal(err, resp.StatusCode)
			}
			resp.Body.Close()
		}
	})
	if err := os.WriteFile(filepath.Join(e.home, "big.bin"), data, 0o644); err != nil {
		b.Fatal(err)
	}
	b.Run("download", func(b *testing.B) {
		b.SetBytes(size)
		buf := make([]byte, 1<<20)
		for b.Loop() {
			resp, err := client.Get(e.url + "/files?path=big.bin")
			if err != nil || resp.StatusCode != 200 {
				b.Fatal(err)
			}
			n, _ := io.CopyBuffer(io.Discard, struct{ io.Reader }{resp.Body}, buf)
			resp.Body.Close()
			if n != size {
				b.Fatalf("got %d", n)
			}
		}
	})
}
