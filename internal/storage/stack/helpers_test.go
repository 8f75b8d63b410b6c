package stack

import "github.com/aenv-dev/aenv/internal/storage/lsmt"

func lsmtCommitOptions() lsmt.CommitOptions { return lsmt.CommitOptions{UserTag: "flat"} }
