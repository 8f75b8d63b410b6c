package bench

import (
	"bytes"
	"errors"
	"strings"
	"testing"
	"time"
)

func msList(v ...int) []time.Duration {
	out := make([]time.Duration, len(v))
	for i, x := range v {
		out[i] = time.Duration(x) * time.Millisecond
	}
	return out
}

func TestPercentile(t *testing.T) {
	hundred := make([]int, 100)
	for i := range hundred {
		hundred[i] = i + 1
	}
	tests := []struct {
		name   string
		sorted []time.Duration
		p      float64
		want   time.Duration
	}{
		{"empty", nil, 50, 0},
		{"single", msList(7), 99, 7 * time.Millisecond},
		{"median of odd", msList(1, 2, 3), 50, 2 * time.Millisecond},
		{"median of even is the lower middle", msList(1, 2, 3, 4), 50, 2 * time.Millisecond},
		{"p95 of 1..100", msList(hundred...), 95, 95 * time.Millisecond},
		{"p99 of 1..100", msList(hundred...), 99, 99 * time.Millisecond},
		{"p100 is the max", msList(hundred...), 100, 100 * time.Millisecond},
		{"p99 of 10 is the max", msList(1, 2, 3, 4, 5, 6, 7, 8, 9, 10), 99, 10 * time.Millisecond},
		{"tiny p is the min", msList(5, 6, 7), 0.1, 5 * time.Millisecond},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := Percentile(tt.sorted, tt.p); got != tt.want {
				t.Errorf("Percentile(%v, %v) = %v, want %v", tt.sorted, tt.p, got, tt.want)
			}
		})
	}
}

func TestSummarize(t *testing.T) {
	in := msList(30, 10, 20, 40)
	got := Summarize(in)
	want := Summary{N: 4, Min: 10 * time.Millisecond, P50: 20 * time.Millisecond, P95: 40 * time.Millisecond,
		P99: 40 * time.Millisecond, Max: 40 * time.Millisecond, Mean: 25 * time.Millisecond}
	if got != want {
		t.Errorf("Summarize = %+v, want %+v", got, want)
	}
	if in[0] != 30*time.Millisecond {
		t.Errorf("Summarize sorted its input in place: %v", in)
	}
	if got := Summarize(nil); got != (Summary{}) {
		t.Errorf("Summarize(nil) = %+v, want zero", got)
	}
}

func TestParseMemAvailable(t *testing.T) {
	tests := []struct {
		name    string
		in      string
		want    int64
		wantErr bool
	}{
		{"real layout", "MemTotal:       24551636 kB\nMemFree:         1234 kB\nMemAvailable:   20000000 kB\nBuffers: 1 kB\n", 20000000 * 1024, false},
		{"missing", "MemTotal: 1 kB\nMemFree: 1 kB\n", 0, true},
		{"not a number", "MemAvailable: lots kB\n", 0, true},
		{"wrong unit", "MemAvailable: 12 MB\n", 0, true},
		{"negative", "MemAvailable: -12 kB\n", 0, true},
		{"empty", "", 0, true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := parseMemAvailable(strings.NewReader(tt.in))
			if (err != nil) != tt.wantErr || got != tt.want {
				t.Errorf("parseMemAvailable = %d, %v; want %d, error %v", got, err, tt.want, tt.wantErr)
			}
		})
	}
}

func TestSummarizeRun(t *testing.T) {
	samples := []sample{
		{create: 10 * time.Millisecond, command: 5 * time.Millisecond, client: 2 * time.Millisecond},
		{err: errors.New("create sandbox: HTTP 503: full")},
		{create: 20 * time.Millisecond, command: 10 * time.Millisecond, client: 4 * time.Millisecond},
		{err: errors.New("create sandbox: HTTP 503: full")},
		{create: 30 * time.Millisecond, command: 15 * time.Millisecond},
	}
	r := summarizeRun("rest", 2, samples, time.Second)
	if r.N != 5 || r.Failures != 2 || r.Total.N != 3 {
		t.Fatalf("counts: n=%d failures=%d ok=%d, want 5, 2, 3", r.N, r.Failures, r.Total.N)
	}
	if r.Total.P50 != 30*time.Millisecond || r.Create.P50 != 20*time.Millisecond || r.Command.Max != 15*time.Millisecond {
		t.Errorf("summaries: total p50 %v, create p50 %v, command max %v", r.Total.P50, r.Create.P50, r.Command.Max)
	}
	if r.Client.N != 2 || r.Client.P50 != 2*time.Millisecond || r.Client.Max != 4*time.Millisecond {
		t.Errorf("client: %+v, want the two measured samples only", r.Client)
	}
	if len(r.Errors) != 1 {
		t.Errorf("repeated errors should be kept once, got %q", r.Errors)
	}
	if r.Rate != 3 {
		t.Errorf("rate = %v, want 3 successes per second", r.Rate)
	}
}

func TestCombine(t *testing.T) {
	run := func(p50, p99 int, fail int) Result {
		return Result{Mode: "rest", Concurrency: 16, N: 10, Failures: fail, Rate: float64(p50),
			Total: Summary{N: 10 - fail, P50: time.Duration(p50) * time.Millisecond, P99: time.Duration(p99) * time.Millisecond}}
	}
	got := Combine([]Result{run(40, 100, 0), run(60, 90, 1), run(50, 300, 0)})
	if got.Total.P50 != 50*time.Millisecond || got.Total.P99 != 100*time.Millisecond {
		t.Errorf("medians: p50 %v p99 %v, want 50ms 100ms", got.Total.P50, got.Total.P99)
	}
	if got.N != 30 || got.Failures != 1 || got.Total.N != 29 || got.Concurrency != 16 || got.Rate != 50 {
		t.Errorf("counts: %+v", got)
	}
	if got := Combine(nil); got.N != 0 || got.Mode != "" {
		t.Errorf("Combine(nil) = %+v", got)
	}
}

func TestParseSDKOutput(t *testing.T) {
	tests := []struct {
		name      string
		in        string
		wantErr   bool
		wantN     int
		wantFails int
		wantP50   time.Duration
		wantCli   Summary
		wantCPU   time.Duration
	}{
		{"samples", `{"mode":"sdk","concurrency":16,"wallMs":1000,"samples":[{"createMs":20,"commandMs":10},{"createMs":0,"commandMs":0,"error":"boom"},{"createMs":40,"commandMs":10}]}`,
			false, 3, 1, 30 * time.Millisecond, Summary{}, 0},
		{"client split", `{"mode":"sdk","concurrency":16,"wallMs":1000,"clientCpuMs":7.5,"samples":[{"createMs":20,"commandMs":10,"clientMs":3},{"createMs":40,"commandMs":10,"clientMs":5}]}`,
			false, 2, 0, 30 * time.Millisecond, Summary{N: 2, Min: 3 * time.Millisecond, P50: 3 * time.Millisecond, P95: 5 * time.Millisecond,
				P99: 5 * time.Millisecond, Max: 5 * time.Millisecond, Mean: 4 * time.Millisecond}, 7500 * time.Microsecond},
		{"no samples", `{"mode":"sdk","samples":[]}`, true, 0, 0, 0, Summary{}, 0},
		{"not json", "Error: E2B_API_URL is not set", true, 0, 0, 0, Summary{}, 0},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r, err := parseSDKOutput([]byte(tt.in))
			if (err != nil) != tt.wantErr {
				t.Fatalf("err = %v, want error %v", err, tt.wantErr)
			}
			if err != nil {
				return
			}
			if r.Mode != "sdk" || r.N != tt.wantN || r.Failures != tt.wantFails || r.Total.P50 != tt.wantP50 || r.Concurrency != 16 {
				t.Errorf("got %+v", r)
			}
			if r.Client != tt.wantCli || r.ClientCPU != tt.wantCPU {
				t.Errorf("client %+v cpu %v, want %+v %v", r.Client, r.ClientCPU, tt.wantCli, tt.wantCPU)
			}
		})
	}
}

func TestReportWrite(t *testing.T) {
	runs := [][]Result{{{Mode: "rest", Concurrency: 1, N: 2, Failures: 1, Errors: []string{"kill x: HTTP 500: oops"},
		Total: Summary{N: 1, P50: 42 * time.Millisecond}}},
		{{Mode: "sdk", Concurrency: 1, N: 1, Total: Summary{N: 1, P50: 50 * time.Millisecond},
			Client: Summary{N: 1, P50: 9 * time.Millisecond}, ClientCPU: 12 * time.Millisecond}}}
	var table, js bytes.Buffer
	rep := NewCreateReport(runs)
	if err := rep.Write(&table, "table"); err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"p50", "42.0ms", "rest c=1 failure: kill x: HTTP 500: oops", "client p50", "9.0ms",
		"sdk c=1 client (node.js) cpu/sbx 12.0ms"} {
		if !strings.Contains(table.String(), want) {
			t.Errorf("table lacks %q:\n%s", want, table.String())
		}
	}
	if err := rep.Write(&js, "json"); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(js.String(), `"medians"`) || !strings.Contains(js.String(), `"p50": 42000000`) {
		t.Errorf("json:\n%s", js.String())
	}
}

func TestProgress(t *testing.T) {
	var b bytes.Buffer
	p := NewProgress(&b, true)
	p.Label("create")
	p.Update(10, 200)
	p.Update(9, 9)
	p.Done()
	if got, want := b.String(), "\rcreate: 10/200\rcreate: 9/9   \r           \r"; got != want {
		t.Errorf("drawn %q, want %q", got, want)
	}
	var nilP *Progress = NewProgress(&b, false)
	if nilP != nil {
		t.Fatal("NewProgress without a terminal should draw nothing")
	}
	nilP.Update(1, 2) // must not panic
}
