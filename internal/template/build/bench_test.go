package build

import (
	"context"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/aenv-dev/aenv/internal/orchestrator"
)

// benchDockerfile is a small Dockerfile: a few files written, a user-visible workdir,
// metadata, a start command.
const benchDockerfile = `FROM oci:%s
ENV APP_ENV=bench
WORKDIR /srv
RUN echo built > built.txt && dd if=/dev/zero of=data bs=1M count=8 2>/dev/null
RUN mkdir -p /opt/app && for i in 1 2 3 4 5 6 7 8; do echo $i > /opt/app/f$i; done
EXPOSE 8080
LABEL bench=yes
CMD ["sleep", "3600"]
`

// BenchmarkBuildDockerfile builds a small Dockerfile on an imported image (the import is
// made before the timer starts) on a node with layered roots, capturing the build
// sandbox by tar into a directory (the fallback, and what every build did before) or by
// sealing its upper into a layer. Compare the two under the same load.
func BenchmarkBuildDockerfile(b *testing.B) {
	for _, mode := range []struct {
		name string
		cap  Capturer
	}{{"tar", TarCapture{}}, {"layers", nil}} {
		b.Run(mode.name, func(b *testing.B) {
			n := newNode(b, Config{Capturer: mode.cap, ImageDiskMB: 1024}, true)
			df, err := ParseDockerfile(strings.NewReader(strings.Replace(benchDockerfile, "%s", baseImage(b, n, nil), 1)), nil)
			if err != nil {
				b.Fatal(err)
			}
			spec := df.Spec()
			n.mustBuild(b, "bench", spec) // imports the image
			b.ResetTimer()
			// The record's times, not the status polling's, are the build's.
			var took []time.Duration
			for b.Loop() {
				rec := n.mustBuild(b, "bench", spec)
				took = append(took, rec.FinishedAt.Sub(rec.CreatedAt))
			}
			slices.Sort(took)
			b.ReportMetric(float64(took[len(took)/2].Microseconds())/1000, "p50-build-ms")
		})
	}
}

// BenchmarkCreateFromBuilt is the create latency (Create until envd answers) of
// sandboxes from a built template, directory (tar) or layered, and for reference from
// the layered base it was built on.
func BenchmarkCreateFromBuilt(b *testing.B) {
	for _, mode := range []struct {
		name, tpl string
		cap       Capturer
	}{{"tar", "bench", TarCapture{}}, {"layers", "bench", nil}, {"base", "base", nil}} {
		b.Run(mode.name, func(b *testing.B) {
			n := newNode(b, Config{Capturer: mode.cap}, true)
			n.mustBuild(b, "bench", Spec{FromTemplate: "base", Steps: []Step{{Type: StepRun, Args: []string{"echo built > /home/user/built.txt"}}}})
			ctx := context.Background()
			var lat []time.Duration
			for b.Loop() {
				start := time.Now()
				sb, err := n.orch.Create(ctx, orchestrator.CreateRequest{TemplateID: mode.tpl, Secure: true})
				lat = append(lat, time.Since(start))
				if err != nil {
					b.Fatal(err)
				}
				b.StopTimer()
				if err := n.orch.Kill(ctx, sb.ID); err != nil {
					b.Fatal(err)
				}
				time.Sleep(200 * time.Millisecond) // let the warm pool refill, as between real creates
				b.StartTimer()
			}
			slices.Sort(lat)
			ms := func(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }
			b.ReportMetric(ms(lat[len(lat)/2]), "p50-ms")
			b.ReportMetric(ms(lat[len(lat)*99/100]), "p99-ms")
		})
	}
}

// mustBuild builds and fails the benchmark unless the build is ready.
func (n *realNode) mustBuild(b *testing.B, name string, spec Spec) Record {
	b.Helper()
	rec := n.build(b, name, spec)
	if rec.Status != StatusReady {
		b.Fatalf("build %s: %+v\n%s", rec.Status, rec.Reason, n.logText(rec.ID))
	}
	return rec
}
