package sandbox

import (
	"errors"
	"slices"
	"strings"
	"testing"
)

func TestParseDestinations(t *testing.T) {
	tests := []struct {
		in   []string
		want []string
		err  string
	}{
		{in: nil, want: []string{}},
		{in: []string{"8.8.8.8", " 10.1.2.3/8 ", "10.0.0.0/8"}, want: []string{"8.8.8.8/32", "10.0.0.0/8"}},
		{in: []string{"0.0.0.0/0"}, want: []string{"0.0.0.0/0"}},
		{in: []string{"::ffff:10.0.0.1", "::ffff:10.0.0.0/104"}, want: []string{"10.0.0.1/32", "10.0.0.0/8"}},
		{in: []string{"2001:db8::1/48"}, want: []string{"2001:db8::/48"}},
		{in: []string{"example.com"}, err: "domain name"},
		{in: []string{"*.example.com"}, err: "domain name"},
		{in: []string{"10.0.0.0/33"}, err: "not an IP address or CIDR block"},
		{in: []string{"fe80::1%eth0"}, err: "not an IP address or CIDR block"},
		{in: []string{"localhost"}, err: "not an IP address or CIDR block"},
	}
	for _, tc := range tests {
		t.Run(strings.Join(tc.in, ","), func(t *testing.T) {
			got, err := ParseDestinations("allowOut", tc.in)
			if tc.err != "" {
				if !errors.Is(err, ErrBadDestination) || !strings.Contains(err.Error(), tc.err) || !strings.Contains(err.Error(), "allowOut") {
					t.Fatalf("err = %v, want ErrBadDestination mentioning %q", err, tc.err)
				}
				return
			}
			if err != nil || !slices.Equal(FormatDestinations(got), tc.want) {
				t.Fatalf("ParseDestinations(%q) = %v, %v; want %v", tc.in, got, err, tc.want)
			}
		})
	}
}
