# aenv — build, serve and test. The two set-up commands are `make serve` and `make test`.
SHELL := /bin/bash
GO ?= go
BIN := bin
DATA_DIR ?= /var/lib/aenv
export CGO_ENABLED ?= 0

.PHONY: all deps test-deps build binaries base guest serve test unit race e2e lint gen check-generated clean k8s-test-bins

all: build

deps:
	@scripts/deps.sh

# What `make test` needs besides: a C compiler for the race detector.
test-deps:
	@scripts/deps.sh --test

# envd runs once per sandbox and seldom collects (see docs/operations.md, "Memory"): built
# without Go 1.26's Green Tea collector, whose mark bits inside each small-object span cost
# an idle envd ~70 KiB more. A Go release that drops the opt-out fails this build loudly.
binaries:
	$(GO) build -trimpath -o $(BIN)/aenv ./cmd/aenv
	CGO_ENABLED=0 GOEXPERIMENT=nogreenteagc $(GO) build -trimpath -ldflags='-s -w' -o $(BIN)/envd ./cmd/envd

# The base template's root filesystem: Debian with python3, node, git, curl and sudo, made
# with debootstrap once per machine (a few minutes) and kept in $(BASE_CACHE), with the
# downloaded packages; bin/base-rootfs links to it. base-minimal (busybox + bash) the node
# builds itself in a second.
BASE_CACHE ?= /var/cache/aenv
base: binaries
	$(BIN)/aenv template build-base --out $(BASE_CACHE)/base-debian --cache $(BASE_CACHE)/debootstrap
	@[ -L $(BIN)/base-rootfs ] || rm -rf $(BIN)/base-rootfs
	ln -sfn $(BASE_CACHE)/base-debian $(BIN)/base-rootfs

# The microvm backend's guest: Debian's cloud kernel as a PVH vmlinux and a busybox initramfs
# (fetched with apt-get download into a cache; skipped when bin/microvm is up to date).
guest:
	@scripts/microvm-guest.sh $(BIN)/microvm

build: binaries base guest

serve: deps build
	$(BIN)/aenv serve --data-dir $(DATA_DIR) --envd $(BIN)/envd --base-rootfs $(BIN)/base-rootfs

gen:
	@scripts/gen.sh

# Regenerates everything and fails when the checked-in generated code differs.
check-generated:
	@scripts/check-generated.sh

lint:
	@out=$$(gofmt -l $$(git ls-files '*.go')); if [ -n "$$out" ]; then echo "gofmt needed:"; echo "$$out"; exit 1; fi
	$(GO) vet ./...
	$(GO) tool staticcheck ./...

# The repository tests run against a real S3 server process (versitygw, built once from the Go proxy).
unit:
	scripts/s3-test-server.sh install
	$(GO) test -count=1 -timeout 40m ./...

# The race detector (cgo) over the packages whose state many goroutines share: the
# orchestrator (its 64-way create/fork/kill test), the catalog's group commit, scheduler,
# gateway, relay, envd, block cache, layer stacks, node cache, data plane, block devices
# and the network pool. Not every package: -race makes the LSMT and the backends' tests
# many minutes long on 2 vCPUs.
RACE_PKGS := ./internal/orchestrator/ ./internal/catalog/ ./internal/cluster/scheduler/ \
	./internal/cluster/gateway/ ./internal/relay/ ./internal/envd/ ./internal/storage/cache/ \
	./internal/storage/stack/ ./internal/repository/nodecache/ ./internal/dataplane/ \
	./internal/storage/blockdev/ ./internal/network/
race:
	CGO_ENABLED=1 $(GO) test -race -count=1 -timeout 20m $(RACE_PKGS)

# A real etcd and kube-apiserver for the Kubernetes tests (built once per machine; ~10 CPU-minutes cold;
# a no-op when they exist). `make test` builds them first, so CI runs the Kubernetes tests.
k8s-test-bins:
	@scripts/k8s-test-bins.sh

# kubeapi-test: a test Kubernetes API server the SDK cluster tests elect scheduler leaders on.
e2e: build
	$(GO) build -o $(BIN)/kubeapi-test ./test/kubeapi
	@test/e2e/run.sh

# scripts/deps.sh, the build and the generated-code check in a fresh minimal Debian root
# (debootstrap, cached per machine): catches a package deps.sh forgets.
fresh-check:
	@scripts/fresh-check.sh

test: test-deps check-generated lint build k8s-test-bins unit race e2e fresh-check

clean:
	rm -rf $(BIN)
