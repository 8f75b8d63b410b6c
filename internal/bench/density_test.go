package bench

import (
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
)

// TestBlockMeter: a fill is cut into blocks of o.Block creates (plus the partial last
// one), and stops once MemAvailable is below the floor, naming it.
func TestBlockMeter(t *testing.T) {
	tests := []struct {
		name      string
		availKB   int64
		floor     int64
		creates   int
		wantHeld  []int
		wantPrefx string // of the first stop reason; "" = never stops
	}{
		{"blocks and a partial one", 8 << 20, 4 << 30, 25, []int{10, 20, 25}, ""},
		{"exact blocks", 8 << 20, 4 << 30, 20, []int{10, 20}, ""},
		{"below the floor", 1 << 20, 4 << 30, 25, []int{10, 20, 25}, "host MemAvailable 1024.0 MiB is below the floor"},
		{"no floor", 1 << 20, -1, 5, []int{5}, ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			mi := filepath.Join(t.TempDir(), "meminfo")
			if err := os.WriteFile(mi, []byte("MemTotal: 1 kB\nMemAvailable: "+strconv.FormatInt(tt.availKB, 10)+" kB\n"), 0o644); err != nil {
				t.Fatal(err)
			}
			b := newBlockMeter(DensityOptions{Block: 10, MinAvailable: tt.floor, MemInfo: mi})
			first := ""
			for n := 1; n <= tt.creates; n++ {
				if why := b.created(n); why != "" && first == "" {
					first = why
					if n != memCheckEvery {
						t.Errorf("stopped at %d, want at the first check (%d)", n, memCheckEvery)
					}
				}
			}
			b.flush(tt.creates)
			b.flush(tt.creates) // nothing new: no empty row
			var held []int
			total := 0
			for _, r := range b.rows {
				held = append(held, r.Held)
				total += r.Created
				if r.MemAvailable != tt.availKB*1024 || r.CPU != nil {
					t.Errorf("row %+v: want MemAvailable %d and no CPU", r, tt.availKB*1024)
				}
			}
			if !slices.Equal(held, tt.wantHeld) || total != tt.creates {
				t.Errorf("held %v (total %d), want %v (%d)", held, total, tt.wantHeld, tt.creates)
			}
			if (tt.wantPrefx == "") != (first == "") || !strings.HasPrefix(first, tt.wantPrefx) {
				t.Errorf("stop reason %q, want prefix %q", first, tt.wantPrefx)
			}
		})
	}
}

func TestParseRssAnon(t *testing.T) {
	tests := []struct {
		in      string
		want    int64
		wantErr bool
	}{
		{"Name:\taenv\nVmRSS:\t  10108 kB\nRssAnon:\t    2112 kB\nRssFile:\t 7996 kB\n", 2112 * 1024, false},
		{"VmRSS:\t  10108 kB\n", 0, true},
		{"RssAnon:\t lots kB\n", 0, true},
		{"RssAnon:\t 12 MB\n", 0, true},
	}
	for _, tt := range tests {
		got, err := parseRssAnon([]byte(tt.in))
		if got != tt.want || (err != nil) != tt.wantErr {
			t.Errorf("parseRssAnon(%q) = %d, %v; want %d, error %v", tt.in, got, err, tt.want, tt.wantErr)
		}
	}
}
