package stack

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
)

// overlaybdConfig is the subset of overlaybd's image.json (config.v1.json)
// that describes a stack (reference 1.16).
type overlaybdConfig struct {
	RepoBlobURL string `json:"repoBlobUrl"`
	Lowers      []struct {
		File        string `json:"file"`
		Digest      string `json:"digest"`
		Size        int64  `json:"size"`
		Dir         string `json:"dir"`
		UUID        string `json:"uuid"`
		RepoBlobURL string `json:"repoBlobUrl"`
		GzipIndex   string `json:"gzipIndex"`
		TargetFile  string `json:"targetFile"`
	} `json:"lowers"`
	Upper *struct {
		Mode  string `json:"mode"`
		Index string `json:"index"`
		Data  string `json:"data"`
	} `json:"upper"`
}

// LoadOverlaybdConfig converts an overlaybd image.json into a Manifest.
// Lowers resolve as overlaybd does: file, else dir/overlaybd.commit, else
// dir/overlaybd.sealed, else a remote blob by digest (RepoBlobURL is returned
// for the caller's Resolver). TurboOCI lowers (gzipIndex, targetFile) are
// rejected.
func LoadOverlaybdConfig(path string) (m *Manifest, repoBlobURL string, err error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, "", fmt.Errorf("overlaybd config: %w", err)
	}
	var c overlaybdConfig
	if err := json.Unmarshal(b, &c); err != nil {
		return nil, "", fmt.Errorf("overlaybd config %s: %w", path, err)
	}
	m = &Manifest{Dir: filepath.Dir(path)}
	for i, l := range c.Lowers {
		if l.GzipIndex != "" || l.TargetFile != "" {
			return nil, "", fmt.Errorf("overlaybd config %s: lower %d is a TurboOCI layer (unsupported)", path, i)
		}
		ref := LayerRef{Path: l.File, Digest: l.Digest, Size: l.Size, UUID: l.UUID}
		if ref.Path == "" && l.Dir != "" {
			for _, name := range []string{"overlaybd.commit", "overlaybd.sealed"} {
				if _, err := os.Stat(m.abs(filepath.Join(l.Dir, name))); err == nil {
					ref.Path = filepath.Join(l.Dir, name)
					break
				}
			}
		}
		if ref.Path == "" && ref.Digest == "" {
			return nil, "", fmt.Errorf("overlaybd config %s: lower %d has no file, dir or digest", path, i)
		}
		m.Lowers = append(m.Lowers, ref)
	}
	if u := c.Upper; u != nil && (u.Data != "" || u.Index != "") {
		switch u.Mode {
		case "", "logStructured":
			m.Upper = &Upper{Data: u.Data, Index: u.Index}
		case "hybridLogStructured":
			m.Upper = &Upper{Data: u.Data, Index: u.Index, Hybrid: true}
		case "sparse":
			m.Upper = &Upper{Data: u.Data, Sparse: true}
		default:
			return nil, "", fmt.Errorf("overlaybd config %s: upper mode %q unsupported", path, u.Mode)
		}
	}
	if err := m.validate(); err != nil {
		return nil, "", fmt.Errorf("overlaybd config %s: %w", path, err)
	}
	return m, c.RepoBlobURL, nil
}
