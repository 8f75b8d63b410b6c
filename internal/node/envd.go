package node

import (
	"fmt"
	"os"
	"path/filepath"
)

// findEnvd resolves the envd binary: the configured path, else "envd" next to aenv.
func findEnvd(path string) (string, error) {
	if path == "" {
		exe, err := os.Executable()
		if err != nil {
			return "", fmt.Errorf("locate envd: %w (pass --envd)", err)
		}
		path = filepath.Join(filepath.Dir(exe), "envd")
	}
	abs, err := filepath.Abs(path)
	if err != nil {
		return "", err
	}
	fi, err := os.Stat(abs)
	if err != nil || fi.IsDir() || fi.Mode()&0o111 == 0 {
		return "", fmt.Errorf("envd binary %s is missing or not executable (build it with `make binaries`, or pass --envd / set AENV_ENVD_PATH)", abs)
	}
	return abs, nil
}
