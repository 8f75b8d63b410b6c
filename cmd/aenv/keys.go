package main

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"

	"github.com/aenv-dev/aenv/internal/catalog"
	"github.com/aenv-dev/aenv/internal/config"
	"github.com/aenv-dev/aenv/internal/node"
	"github.com/aenv-dev/aenv/internal/server/api"
)

// catalogFile is the node's catalog inside its data directory.
const catalogFile = node.CatalogFile

// keyStore is where `aenv keys` acts: the node's catalog when it can be opened (the node
// is stopped, or this is a fresh data dir), otherwise the running node's API.
type keyStore struct {
	cat *catalog.Catalog
	c   *client
}

func openKeyStore(g *globals, dataDir string) (*keyStore, error) {
	g.dataDir = dataDir
	path := filepath.Join(dataDir, catalogFile)
	if _, err := os.Stat(path); err == nil {
		cat, err := catalog.Open(path)
		if err == nil {
			return &keyStore{cat: cat}, nil
		}
		// bbolt's lock is held by a running `aenv serve`: go through its API instead.
		c, cerr := g.client()
		if cerr != nil {
			return nil, fmt.Errorf("open %s: %w; and the node's API is not usable either: %w", path, err, cerr)
		}
		return &keyStore{c: c}, nil
	}
	c, err := g.client()
	if err != nil {
		return nil, fmt.Errorf("no catalog at %s (pass --data-dir) and no node to ask: %w", path, err)
	}
	return &keyStore{c: c}, nil
}

func (k *keyStore) close() {
	if k.cat != nil {
		k.cat.Close()
	}
}

func newKeysCmd(g *globals) *cobra.Command {
	var dataDir string
	cmd := &cobra.Command{
		Use:   "keys",
		Short: "Manage the node's API keys (on the node's catalog, or through its API while it runs)",
	}
	cmd.PersistentFlags().StringVar(&dataDir, "data-dir", "", "the node's data directory (default $AENV_DATA_DIR or "+config.Default().DataDir+")")
	resolveDir := func() string {
		return firstNonEmpty(dataDir, os.Getenv("AENV_DATA_DIR"), config.Default().DataDir)
	}

	create := &cobra.Command{
		Use:   "create NAME",
		Short: "Create an API key and print it (it cannot be shown again)",
		Args:  cobra.ExactArgs(1),
		RunE: func(c *cobra.Command, args []string) error {
			ks, err := openKeyStore(g, resolveDir())
			if err != nil {
				return err
			}
			defer ks.close()
			if ks.cat != nil {
				key, _, err := ks.cat.APIKeys().Create(args[0])
				if err != nil {
					return err
				}
				fmt.Fprintln(c.OutOrStdout(), key)
				return nil
			}
			resp, err := ks.c.api.CreateAPIKeyWithResponse(c.Context(), api.NewAPIKey{Name: args[0]})
			if err != nil {
				return ks.c.transportErr(err)
			}
			if resp.JSON201 == nil {
				return ks.c.apiErr("create key", resp.StatusCode(), resp.Body)
			}
			fmt.Fprintln(c.OutOrStdout(), resp.JSON201.Key)
			return nil
		},
	}
	var output string
	list := &cobra.Command{
		Use:     "list",
		Aliases: []string{"ls"},
		Short:   "List API keys (names and prefixes; secrets are never stored)",
		Args:    cobra.NoArgs,
		RunE: func(c *cobra.Command, _ []string) error {
			ks, err := openKeyStore(g, resolveDir())
			if err != nil {
				return err
			}
			defer ks.close()
			var keys []api.APIKeyInfo
			if ks.cat != nil {
				recs, err := ks.cat.APIKeys().List()
				if err != nil {
					return err
				}
				for _, r := range recs {
					info := api.APIKeyInfo{Id: r.ID, Name: r.Name, Prefix: r.Prefix, CreatedAt: r.CreatedAt}
					if !r.LastUsed.IsZero() {
						lu := r.LastUsed
						info.LastUsed = &lu
					}
					keys = append(keys, info)
				}
			} else {
				resp, err := ks.c.api.ListAPIKeysWithResponse(c.Context())
				if err != nil {
					return ks.c.transportErr(err)
				}
				if resp.JSON200 == nil {
					return ks.c.apiErr("list keys", resp.StatusCode(), resp.Body)
				}
				keys = *resp.JSON200
			}
			if output == "json" || (output == "" && !isTerminal(os.Stdout)) {
				if keys == nil {
					keys = []api.APIKeyInfo{}
				}
				return encodeIndented(c.OutOrStdout(), keys)
			}
			tw := tabwriter.NewWriter(c.OutOrStdout(), 0, 4, 2, ' ', 0)
			fmt.Fprintln(tw, "ID\tNAME\tPREFIX\tCREATED\tLAST USED")
			for _, k := range keys {
				last := "never"
				if k.LastUsed != nil {
					last = k.LastUsed.Local().Format(time.DateTime)
				}
				fmt.Fprintf(tw, "%s\t%s\t%s…\t%s\t%s\n", k.Id, k.Name, k.Prefix, k.CreatedAt.Local().Format(time.DateTime), last)
			}
			return tw.Flush()
		},
	}
	list.Flags().StringVarP(&output, "output", "o", "", "table or json (default: table on a terminal, json otherwise)")
	revoke := &cobra.Command{
		Use:   "revoke ID|NAME",
		Short: "Revoke an API key",
		Args:  cobra.ExactArgs(1),
		RunE: func(c *cobra.Command, args []string) error {
			ks, err := openKeyStore(g, resolveDir())
			if err != nil {
				return err
			}
			defer ks.close()
			if ks.cat != nil {
				keys, err := ks.cat.APIKeys().List()
				if err != nil {
					return err
				}
				if len(keys) == 1 && (keys[0].ID == args[0] || keys[0].Name == args[0]) {
					return errors.New("refusing to revoke the last API key; create another one first")
				}
				rec, err := ks.cat.APIKeys().Revoke(args[0])
				if err != nil {
					return err
				}
				fmt.Fprintf(c.OutOrStdout(), "revoked %s (%s)\n", rec.Name, rec.ID)
				return nil
			}
			resp, err := ks.c.api.RevokeAPIKeyWithResponse(c.Context(), args[0])
			if err != nil {
				return ks.c.transportErr(err)
			}
			if resp.StatusCode() != 204 {
				return ks.c.apiErr("revoke "+args[0], resp.StatusCode(), resp.Body)
			}
			fmt.Fprintf(c.OutOrStdout(), "revoked %s\n", args[0])
			return nil
		},
	}
	cmd.AddCommand(create, list, revoke)
	return cmd
}
