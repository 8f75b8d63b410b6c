package main

import (
	"bufio"
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"github.com/BurntSushi/toml"
	"github.com/spf13/cobra"
)

func newLoginCmd(g *globals) *cobra.Command {
	return &cobra.Command{
		Use:   "login",
		Short: "Save the node URL and API key for later commands",
		Long: "login checks the URL and key against the node and writes them to\n" +
			"~/.config/aenv/credentials.toml (mode 0600). Without --url/--api-key it asks for them.",
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			in := bufio.NewReader(cmd.InOrStdin())
			ask := func(prompt, def string) (string, error) {
				fmt.Fprintf(cmd.ErrOrStderr(), "%s [%s]: ", prompt, def)
				line, err := in.ReadString('\n')
				if err != nil && line == "" {
					return "", fmt.Errorf("read %s: %w", prompt, err)
				}
				if line = strings.TrimSpace(line); line != "" {
					return line, nil
				}
				return def, nil
			}
			var err error
			if g.url == "" {
				if g.url, err = ask("Node URL", firstNonEmpty(os.Getenv("AENV_URL"), defaultURL)); err != nil {
					return err
				}
			}
			if g.apiKey == "" {
				if g.apiKey, err = ask("API key", os.Getenv("AENV_API_KEY")); err != nil {
					return err
				}
			}
			c, err := g.client()
			if err != nil {
				return err
			}
			resp, err := c.api.ListSandboxesV2WithResponse(cmd.Context(), nil)
			if err != nil {
				return c.transportErr(err)
			}
			if resp.JSON200 == nil {
				return c.apiErr("check the credentials", resp.StatusCode(), resp.Body)
			}
			path, err := credentialsPath()
			if err != nil {
				return err
			}
			var buf bytes.Buffer
			if err := toml.NewEncoder(&buf).Encode(credentials{URL: c.base, APIKey: c.key}); err != nil {
				return err
			}
			if err := os.MkdirAll(filepath.Dir(path), 0o700); err != nil {
				return err
			}
			if err := os.WriteFile(path, buf.Bytes(), 0o600); err != nil {
				return err
			}
			// WriteFile keeps the mode of an existing file; make sure it is private.
			if err := os.Chmod(path, 0o600); err != nil {
				return err
			}
			fmt.Fprintf(cmd.OutOrStdout(), "logged in to %s; credentials saved in %s\n", c.base, path)
			return nil
		},
	}
}
