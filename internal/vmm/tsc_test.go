package vmm

import "testing"

func TestParseTSC(t *testing.T) {
	for _, tc := range []struct {
		name string
		log  string
		want int
	}{
		{"detected", "6,1,262,-;tsc: Detected 2095.987 MHz processor\n", 2095987},
		{"refined wins", "tsc: Detected 2600.000 MHz processor\ntsc: Refined TSC clocksource calibration: 2599.991 MHz\n", 2599991},
		{"refined then detected", "tsc: Refined TSC clocksource calibration: 2599.991 MHz\ntsc: Detected 2600.000 MHz processor\n", 2599991},
		{"short fraction", "tsc: Detected 3000.5 MHz processor", 3000500},
		{"none", "Linux version 6.18\n", 0},
		{"garbage", "tsc: Detected x MHz processor", 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := tscFromKernelLog([]byte(tc.log)); got != tc.want {
				t.Fatalf("got %d, want %d", got, tc.want)
			}
		})
	}
	if got := tscFromCPUInfo([]byte("processor\t: 0\ncpu MHz\t\t: 2095.987\n")); got != 2095987 {
		t.Fatalf("cpuinfo: got %d", got)
	}
	khz, err := HostTSCKHz()
	if err != nil || khz <= 0 {
		t.Fatalf("HostTSCKHz = %d, %v", khz, err)
	}
	t.Logf("host TSC %d kHz", khz)
}
