// Command envd is the in-sandbox daemon the E2B SDKs talk to.
package main

import (
	"fmt"
	"os"
)

func main() {
	fmt.Fprintln(os.Stderr, "envd: not built yet")
	os.Exit(2)
}
