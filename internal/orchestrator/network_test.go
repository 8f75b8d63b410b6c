package orchestrator

import (
	"context"
	"errors"
	"net/netip"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/aenv-dev/aenv/internal/sandbox"
	"github.com/aenv-dev/aenv/internal/sandbox/mock"
)

func TestParseEgress(t *testing.T) {
	tests := []struct {
		name        string
		allow, deny []string
		want        Egress
		err         string
	}{
		{name: "empty", want: Egress{}},
		{name: "canonical", allow: []string{"1.2.3.4", "10.1.2.3/8"}, deny: []string{"0.0.0.0/0", "::ffff:1.2.3.4"},
			want: Egress{AllowOut: []string{"1.2.3.4/32", "10.0.0.0/8"}, DenyOut: []string{"0.0.0.0/0", "1.2.3.4/32"}}},
		{name: "ipv6 kept", deny: []string{"2001:db8::1"}, want: Egress{DenyOut: []string{"2001:db8::1/128"}}},
		{name: "domains", allow: []string{"Example.COM.", "*.example.com", "1.2.3.4", "example.com"},
			want: Egress{AllowOut: []string{"1.2.3.4/32", "example.com", "*.example.com"}}},
		{name: "domain in denyOut", deny: []string{"example.com"}, err: "domain name"},
		{name: "bare wildcard", allow: []string{"*"}, err: "bare wildcard"},
		{name: "inner wildcard", allow: []string{"a.*.example.com"}, err: "not a DNS label"},
		{name: "single label", allow: []string{"localhost"}, err: "single-label"},
		{name: "bad prefix", deny: []string{"1.2.3.4/40"}, err: "network.denyOut"},
		{name: "empty entry", deny: []string{""}, err: "not an IP address"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			got, err := ParseEgress(tc.allow, tc.deny, nil, nil)
			if tc.err != "" {
				if !errors.Is(err, ErrInvalid) || !errors.Is(err, sandbox.ErrBadDestination) || !strings.Contains(err.Error(), tc.err) {
					t.Fatalf("err = %v, want ErrInvalid mentioning %q", err, tc.err)
				}
				return
			}
			if err != nil || !slices.Equal(got.AllowOut, tc.want.AllowOut) || !slices.Equal(got.DenyOut, tc.want.DenyOut) {
				t.Fatalf("ParseEgress = %+v, %v; want %+v", got, err, tc.want)
			}
		})
	}
}

func prefixes(ss ...string) []netip.Prefix {
	out := []netip.Prefix{}
	for _, s := range ss {
		out = append(out, netip.MustParsePrefix(s))
	}
	return out
}

// The policy reaches the instance at create, on update (running and paused in place),
// survives pause to disk and a restart in the record, and is re-applied at resume.
func TestUpdateNetwork(t *testing.T) {
	ctx := context.Background()
	for _, mode := range snapModes {
		t.Run(mode.name, func(t *testing.T) {
			h := newHarness(t, mode.opts, nil)
			eg, err := ParseEgress([]string{"1.1.1.1"}, []string{"0.0.0.0/0"}, nil, nil)
			if err != nil {
				t.Fatal(err)
			}
			sb := h.create(CreateRequest{Timeout: time.Minute, AllowInternet: true, Egress: eg})
			got, _ := h.inst(sb.ID).Egress()
			if !got.AllowInternet || !slices.Equal(got.AllowOut, prefixes("1.1.1.1/32")) || !slices.Equal(got.DenyOut, prefixes("0.0.0.0/0")) {
				t.Fatalf("egress at create = %+v", got)
			}

			// Live update; the record and the stored record follow.
			upd := NetworkUpdate{AllowInternet: false, Egress: Egress{AllowOut: []string{"8.8.8.8/32"}}}
			if err := h.o.UpdateNetwork(ctx, sb.ID, upd); err != nil {
				t.Fatal(err)
			}
			got, _ = h.inst(sb.ID).Egress()
			if got.AllowInternet || !slices.Equal(got.AllowOut, prefixes("8.8.8.8/32")) || len(got.DenyOut) != 0 {
				t.Fatalf("egress after update = %+v", got)
			}
			if rec := h.stored(sb.ID); rec.AllowInternet || !slices.Equal(rec.Egress.AllowOut, []string{"8.8.8.8/32"}) {
				t.Fatalf("stored record = %+v", rec)
			}

			// Bad input changes nothing.
			if err := h.o.UpdateNetwork(ctx, sb.ID, NetworkUpdate{Egress: Egress{DenyOut: []string{"nope"}}}); !errors.Is(err, ErrInvalid) {
				t.Fatalf("bad update: %v", err)
			}
			if err := h.o.UpdateNetwork(ctx, "missing", NetworkUpdate{}); !errors.Is(err, ErrNotFound) {
				t.Fatalf("unknown sandbox: %v", err)
			}
			// A failing backend leaves the old policy in the record.
			h.b.Fail(mock.StageEgress, errors.New("nft broke"), 1)
			if err := h.o.UpdateNetwork(ctx, sb.ID, NetworkUpdate{AllowInternet: true}); err == nil {
				t.Fatal("update succeeded although the backend failed")
			}
			if cur, _ := h.o.Get(ctx, sb.ID); cur.AllowInternet || !slices.Equal(cur.Egress.AllowOut, []string{"8.8.8.8/32"}) {
				t.Fatalf("record after failed update = %+v", cur)
			}

			// Paused: updated in the record (and on the frozen instance if it survived),
			// applied when it runs again, also after a node restart.
			if err := h.o.Pause(ctx, sb.ID, sandbox.PauseOptions{KeepMemory: true}); err != nil {
				t.Fatal(err)
			}
			final := NetworkUpdate{AllowInternet: true, Egress: Egress{DenyOut: []string{"10.0.0.0/8"}}}
			if err := h.o.UpdateNetwork(ctx, sb.ID, final); err != nil {
				t.Fatal(err)
			}
			if h.state(sb.ID) != StatePaused {
				t.Fatalf("state after update = %s, want paused", h.state(sb.ID))
			}
			h.restart()
			if _, _, err := h.o.Connect(ctx, sb.ID, ConnectOptions{Timeout: time.Minute}); err != nil {
				t.Fatal(err)
			}
			got, _ = h.inst(sb.ID).Egress()
			if !got.AllowInternet || len(got.AllowOut) != 0 || !slices.Equal(got.DenyOut, prefixes("10.0.0.0/8")) {
				t.Fatalf("egress after resume = %+v", got)
			}
			cur, _ := h.o.Get(ctx, sb.ID)
			if !slices.Equal(cur.Egress.DenyOut, []string{"10.0.0.0/8"}) {
				t.Fatalf("record after resume = %+v", cur.Egress)
			}
		})
	}
}

// Fork children inherit the parent's rules.
func TestForkInheritsEgress(t *testing.T) {
	h := newHarness(t, snapModes[0].opts, nil)
	sb := h.create(CreateRequest{Timeout: time.Minute, Egress: Egress{DenyOut: []string{"1.2.3.0/24"}}})
	res, err := h.o.Fork(context.Background(), sb.ID, 1, time.Minute)
	if err != nil || len(res) != 1 || res[0].Err != nil {
		t.Fatalf("fork: %v %+v", err, res)
	}
	got, _ := h.inst(res[0].Sandbox.ID).Egress()
	if got.AllowInternet || !slices.Equal(got.DenyOut, prefixes("1.2.3.0/24")) || !slices.Equal(res[0].Sandbox.Egress.DenyOut, []string{"1.2.3.0/24"}) {
		t.Fatalf("child egress = %+v, record %+v", got, res[0].Sandbox.Egress)
	}
}

// A node restart re-creates its nftables tables: the policy of every adopted sandbox is
// installed again from its record.
func TestEgressReappliedAfterRestart(t *testing.T) {
	h := newHarness(t, snapModes[0].opts, nil)
	sb := h.create(CreateRequest{Timeout: time.Minute, AllowInternet: true, Egress: Egress{DenyOut: []string{"10.0.0.0/8"}}})
	if err := h.o.UpdateNetwork(context.Background(), sb.ID, NetworkUpdate{AllowInternet: false, Egress: Egress{AllowOut: []string{"1.1.1.1/32"}}}); err != nil {
		t.Fatal(err)
	}
	_, before := h.inst(sb.ID).Egress()
	h.restart()
	got, after := h.inst(sb.ID).Egress()
	if after != before+1 || got.AllowInternet || !slices.Equal(got.AllowOut, prefixes("1.1.1.1/32")) || len(got.DenyOut) != 0 {
		t.Fatalf("after restart: %d applies (before %d), policy %+v", after, before, got)
	}
}
