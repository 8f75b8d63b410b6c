package orchestrator

import (
	"context"
	"encoding/base64"
	"errors"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/aenv-dev/aenv/internal/catalog"
	"github.com/aenv-dev/aenv/internal/sandbox"
)

func ids(items []*Sandbox) []string {
	out := make([]string, len(items))
	for i, s := range items {
		out[i] = s.ID
	}
	return out
}

func TestListFilters(t *testing.T) {
	ctx := context.Background()
	h := newHarness(t, backendModes[0].opts, nil)
	if err := h.cat.Templates().Put(catalog.Template{ID: "other", Kind: catalog.KindTemplate, Aliases: []string{"py"}}); err != nil {
		t.Fatal(err)
	}
	mk := func(tpl string, md map[string]string) *Sandbox {
		h.clock.Advance(time.Second)
		return h.create(CreateRequest{TemplateID: tpl, Metadata: md})
	}
	a := mk("base", map[string]string{"user": "a b", "team": "x"})
	b := mk("default", map[string]string{"user": "a b"})
	c := mk("py", map[string]string{"user": "c"})
	d := mk("other", nil)
	if err := h.o.Pause(ctx, b.ID, sandbox.PauseOptions{}); err != nil {
		t.Fatal(err)
	}
	t0 := a.StartedAt

	cases := []struct {
		name string
		f    ListFilter
		want []string
		err  error
	}{
		{name: "all, newest first", want: []string{d.ID, c.ID, b.ID, a.ID}},
		{name: "ascending", f: ListFilter{Ascending: true}, want: []string{a.ID, b.ID, c.ID, d.ID}},
		{name: "running", f: ListFilter{States: []string{"running"}}, want: []string{d.ID, c.ID, a.ID}},
		{name: "paused", f: ListFilter{States: []string{"paused"}}, want: []string{b.ID}},
		{name: "both states", f: ListFilter{States: []string{"running", "paused"}}, want: []string{d.ID, c.ID, b.ID, a.ID}},
		{name: "metadata one pair", f: ListFilter{Metadata: map[string]string{"user": "a b"}}, want: []string{b.ID, a.ID}},
		{name: "metadata all pairs", f: ListFilter{Metadata: map[string]string{"user": "a b", "team": "x"}}, want: []string{a.ID}},
		{name: "metadata no match", f: ListFilter{Metadata: map[string]string{"user": "zzz"}}, want: []string{}},
		{name: "template by id", f: ListFilter{TemplateID: "base"}, want: []string{b.ID, a.ID}},
		{name: "template by alias", f: ListFilter{TemplateID: "py"}, want: []string{d.ID, c.ID}},
		{name: "template unknown", f: ListFilter{TemplateID: "nope"}, want: []string{}},
		{name: "started after is inclusive", f: ListFilter{StartedAfter: t0.Add(2 * time.Second)}, want: []string{d.ID, c.ID}},
		{name: "combined", f: ListFilter{States: []string{"running"}, Metadata: map[string]string{"user": "a b"}}, want: []string{a.ID}},
		{name: "bad state", f: ListFilter{States: []string{"dead"}}, err: ErrInvalid},
		{name: "limit too big", f: ListFilter{Limit: 101}, err: ErrInvalid},
		{name: "negative limit", f: ListFilter{Limit: -1}, err: ErrInvalid},
		{name: "garbage token", f: ListFilter{NextToken: "!!!"}, err: ErrInvalid},
		{name: "token without separator", f: ListFilter{NextToken: base64.RawURLEncoding.EncodeToString([]byte("x"))}, err: ErrInvalid},
		{name: "token with bad time", f: ListFilter{NextToken: base64.RawURLEncoding.EncodeToString([]byte("yesterday__abc"))}, err: ErrInvalid},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			items, next, err := h.o.List(ctx, tc.f)
			if tc.err != nil {
				if !errors.Is(err, tc.err) {
					t.Fatalf("err %v, want %v", err, tc.err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if got := ids(items); !slices.Equal(got, tc.want) {
				t.Fatalf("got %v, want %v", got, tc.want)
			}
			if next != "" {
				t.Fatalf("unexpected next token %q", next)
			}
		})
	}
}

func TestListPaging(t *testing.T) {
	ctx := context.Background()
	h := newHarness(t, backendModes[0].opts, nil)
	var all []*Sandbox
	for i := range 7 {
		if i%3 != 0 { // several sandboxes share a start time: ties break by id
			h.clock.Advance(time.Millisecond)
		}
		all = append(all, h.create(CreateRequest{}))
	}
	for _, asc := range []bool{false, true} {
		want := slices.Clone(all)
		slices.SortFunc(want, func(a, b *Sandbox) int {
			c := a.StartedAt.Compare(b.StartedAt)
			if c == 0 {
				c = strings.Compare(a.ID, b.ID)
			}
			if !asc {
				c = -c
			}
			return c
		})
		for _, limit := range []int{1, 2, 3, 7, 100} {
			var got []string
			token, pages := "", 0
			for {
				items, next, err := h.o.List(ctx, ListFilter{Limit: limit, NextToken: token, Ascending: asc})
				if err != nil {
					t.Fatal(err)
				}
				if len(items) > limit {
					t.Fatalf("page of %d > limit %d", len(items), limit)
				}
				got = append(got, ids(items)...)
				pages++
				if next == "" {
					break
				}
				token = next
				if pages > 10 {
					t.Fatal("paging does not terminate")
				}
			}
			if !slices.Equal(got, ids(want)) {
				t.Fatalf("asc=%v limit=%d: got %v, want %v", asc, limit, got, ids(want))
			}
			if wantPages := (len(all) + limit - 1) / limit; pages != wantPages {
				t.Fatalf("asc=%v limit=%d: %d pages, want %d (no trailing empty page)", asc, limit, pages, wantPages)
			}
		}
	}

	// A sandbox killed between pages does not derail the cursor.
	items, next, _ := h.o.List(ctx, ListFilter{Limit: 2})
	if err := h.o.Kill(ctx, items[1].ID); err != nil {
		t.Fatal(err)
	}
	rest, _, err := h.o.List(ctx, ListFilter{Limit: 100, NextToken: next})
	if err != nil || len(rest) != len(all)-2 {
		t.Fatalf("after killing the cursor item: %d items, %v", len(rest), err)
	}
}

func TestCursorRoundTrip(t *testing.T) {
	c := cursor{startedAt: time.Date(2026, 1, 2, 3, 4, 5, 6789, time.UTC), id: "abc"}
	got, err := decodeCursor(encodeCursor(c))
	if err != nil || !got.startedAt.Equal(c.startedAt) || got.id != c.id {
		t.Fatalf("round trip %+v %v", got, err)
	}
}

func FuzzDecodeCursor(f *testing.F) {
	f.Add(encodeCursor(cursor{startedAt: time.Unix(1, 2), id: "x"}))
	f.Add("")
	f.Add("====")
	f.Fuzz(func(t *testing.T, tok string) {
		c, err := decodeCursor(tok)
		if err != nil {
			if !errors.Is(err, ErrInvalid) {
				t.Fatalf("error %v is not ErrInvalid", err)
			}
			return
		}
		if c.id == "" {
			t.Fatal("accepted a cursor without id")
		}
	})
}
