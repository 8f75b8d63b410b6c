// Command aenv is the aenv CLI and every aenv daemon (serve, and later gateway/scheduler).
package main

import (
	"fmt"
	"os"
)

func main() {
	fmt.Fprintln(os.Stderr, "aenv: not built yet")
	os.Exit(2)
}
