// Shared helpers for the SDK end-to-end tests: start ../../bin/envd on a free port, optionally with
// its own passwd/group files (so a `user` account exists without touching the host), and /init it;
// start and stop ../../bin/aenv serve with a network and cgroup parent of its own.
import { spawn, execFileSync } from 'node:child_process'
import {
  mkdtempSync, mkdirSync, writeFileSync, chmodSync, chownSync, rmSync, existsSync, readFileSync,
  readdirSync, rmdirSync, statSync,
} from 'node:fs'
import { rm } from 'node:fs/promises'
import { createHash, randomInt } from 'node:crypto'
import { createServer } from 'node:net'
import { tmpdir, userInfo, networkInterfaces } from 'node:os'
import { dirname, join, resolve } from 'node:path'
import { fileURLToPath } from 'node:url'

const here = dirname(fileURLToPath(import.meta.url))
export const binDir = resolve(here, '../../bin')

export const isRoot = typeof process.getuid === 'function' && process.getuid() === 0

export async function freePort() {
  return await new Promise((res, rej) => {
    const srv = createServer()
    srv.unref()
    srv.on('error', rej)
    srv.listen(0, '127.0.0.1', () => {
      const { port } = srv.address()
      srv.close(() => res(port))
    })
  })
}

export const sleep = (ms) => new Promise((r) => setTimeout(r, ms))

/**
 * Start envd. With `withUser` (root only) a temporary passwd/group adds `user` (uid/gid 1000-ish,
 * home under a temp dir) next to root. Returns {url, port, dir, home, stop, init(body)}.
 */
export async function startEnvd({ withUser = false, args = [] } = {}) {
  const bin = join(binDir, 'envd')
  if (!existsSync(bin)) throw new Error(`${bin} is missing: run 'make binaries' first`)
  const dir = mkdtempSync(join(tmpdir(), 'envd-e2e-'))
  chmodSync(dir, 0o755)
  const extra = []
  let home = dir
  let user = isRoot ? 'root' : userInfo().username
  if (withUser && isRoot) {
    const uid = 1000
    home = join(dir, 'home', 'user')
    mkdirSync(home, { recursive: true })
    chmodSync(join(dir, 'home'), 0o755)
    chownSync(home, uid, uid)
    writeFileSync(join(dir, 'passwd'),
      `root:x:0:0:root:/root:/bin/bash\nuser:x:${uid}:${uid}:user:${home}:/bin/bash\n`)
    writeFileSync(join(dir, 'group'), `root:x:0:\nuser:x:${uid}:\n`)
    extra.push('--passwd', join(dir, 'passwd'), '--group', join(dir, 'group'))
    user = 'user'
  }
  const port = await freePort()
  const child = spawn(bin, ['--port', String(port), '--host', '127.0.0.1', ...extra, ...args], {
    stdio: ['ignore', 'inherit', 'inherit'],
  })
  let exited = null
  child.on('exit', (code, sig) => { exited = { code, sig } })
  const url = `http://localhost:${port}`
  const deadline = Date.now() + 10_000
  for (;;) {
    if (exited) throw new Error(`envd exited early: ${JSON.stringify(exited)}`)
    try {
      const r = await fetch(`${url}/health`)
      if (r.status === 204) break
    } catch {}
    if (Date.now() > deadline) throw new Error('envd did not become healthy within 10 s')
    await sleep(50)
  }
  const version = (await fetch(`${url}/health`)).headers.get('x-envd-version')
  return {
    url, port, dir, home, user, version, child,
    async init(body, token) {
      const r = await fetch(`${url}/init`, {
        method: 'POST',
        headers: { 'content-type': 'application/json', ...(token ? { 'x-access-token': token } : {}) },
        body: JSON.stringify(body),
      })
      if (r.status !== 204) throw new Error(`/init: ${r.status} ${await r.text()}`)
    },
    async stop() {
      if (!exited) {
        child.kill('SIGTERM')
        for (let i = 0; i < 100 && !exited; i++) await sleep(50)
        if (!exited) child.kill('SIGKILL')
      }
      rmSync(dir, { recursive: true, force: true })
    },
  }
}

// ---------------------------------------------------------------------------------------------
// aenv serve: one node per test file, on a free loopback port with a temporary data dir.

let nodeCounter = 0

const run = (cmd, args) => {
  try {
    return execFileSync(cmd, args, { encoding: 'utf8', stdio: ['ignore', 'pipe', 'pipe'] })
  } catch {
    return null
  }
}

/**
 * The network and cgroup settings of the next node this process starts. A node's startup
 * reconciler removes every netns, veth, nftables rule and cgroup with its names that it does
 * not know, so each node the tests start gets names of its own: n = (pid*8 + counter) % 240
 * (moved on past a bridge or slot namespaces that already exist), bridge and slot prefix "aet<n>" (network.go:
 * at most 15 and 8 of [a-z0-9_-]; netns "aet<n>-<i>", host veths "aet<n>h<i>"), subnet
 * 10.91.<n>.0/24, cgroup parent "aenv-e2e/<pid>-<counter>".
 */
export function nodeNetwork() {
  const counter = nodeCounter++
  let n = (process.pid * 8 + counter) % 240
  let slots = []
  try { slots = readdirSync('/run/netns') } catch {}
  const taken = (k) => existsSync(`/sys/class/net/aet${k}`) || slots.some((s) => s.startsWith(`aet${k}-`))
  for (let i = 0; i < 240 && taken(n); i++) n = (n + 1) % 240
  return {
    bridge: `aet${n}`,
    prefix: `aet${n}`,
    subnet: `10.91.${n}.0/24`,
    cgroupParent: `aenv-e2e/${process.pid}-${counter}`,
  }
}

/**
 * Start `aenv serve` (single-server mode) and wait up to healthTimeoutMs for GET /health = 204.
 * Options: apiKey (required), bin (default ../../bin/aenv), env (extra environment), tag (data
 * dir name prefix), logFile (the node's log is written there by stopNode), shutdownAction
 * (default "stop", so a stopped node leaves no paused sandboxes behind), healthTimeoutMs,
 * netns (run it in this existing network namespace) and host (the address it listens on,
 * default 127.0.0.1; one of the namespace's with netns).
 * Resolves to {skip: reason} when not root or when no OCI runtime works on this host, else
 * to {proc, url, port, dataDir, net, bin, log(), ...}. Give it to stopNode in an after hook.
 */
export async function startNode({
  apiKey, bin = join(binDir, 'aenv'), env = {}, tag = 'aenv-e2e-', logFile = '',
  shutdownAction = 'stop', healthTimeoutMs = 120_000, dataDir: reuseDataDir = '', netns = '', host = '127.0.0.1',
} = {}) {
  if (!isRoot) {
    return { skip: 'needs root (aenv serve runs OCI containers, network namespaces and overlay mounts)' }
  }
  if (!apiKey) throw new Error('startNode: apiKey is required')
  const envdBin = join(binDir, 'envd')
  const baseRootfs = join(binDir, 'base-rootfs')
  // bin/base-rootfs: the Debian base `make base` builds (once per machine); without it the
  // node would build it itself with debootstrap and answer 503 for base meanwhile.
  for (const b of [bin, envdBin, baseRootfs]) {
    if (!existsSync(b)) throw new Error(`${b} is missing: run 'make binaries base' first`)
  }
  const port = await freePort()
  const url = `http://${host}:${port}`
  // dataDir restarts a node on the data dir of one stopped with stopNode(node, {keepDataDir: true}).
  const dataDir = reuseDataDir || mkdtempSync(join(tmpdir(), tag))
  const net = nodeNetwork()
  const args = ['serve', '--listen', `${host}:${port}`, '--data-dir', dataDir, '--envd', envdBin]
  args.push('--base-rootfs', baseRootfs)
  let log = ''
  // In a namespace: nsenter joins only its network namespace (not its mount namespace, as
  // `ip netns exec` would), then execs the node, so proc.pid is the node's and its mounts,
  // cgroups and sandbox namespaces are where cleanupNode looks for them.
  const [cmd, argv] = netns ? ['nsenter', [`--net=/run/netns/${netns}`, '--', bin, ...args]] : [bin, args]
  const proc = spawn(cmd, argv, {
    env: {
      ...process.env,
      AENV_API_KEY: apiKey,
      AENV_LOG_LEVEL: process.env.AENV_E2E_LOG_LEVEL || 'info', // debug: AENV_E2E_LOG_LEVEL=debug
      AENV_SANDBOX_SHUTDOWN_ACTION: shutdownAction,
      AENV_BACKEND_CGROUP_PARENT: net.cgroupParent,
      AENV_NETWORK_BRIDGE: net.bridge,
      AENV_NETWORK_SUBNET: net.subnet,
      AENV_NETWORK_PREFIX: net.prefix,
      ...env,
    },
    stdio: ['ignore', 'pipe', 'pipe'],
  })
  proc.stdout.on('data', (d) => { log += d })
  proc.stderr.on('data', (d) => { log += d })
  const node = { skip: '', proc, url, port, dataDir, net, bin, apiKey, logFile, netns, log: () => log }
  const exited = () => proc.exitCode !== null || proc.signalCode !== null
  const deadline = Date.now() + healthTimeoutMs
  while (Date.now() < deadline) {
    if (exited()) {
      await sleep(100) // the last of its output
      const status = JSON.stringify({ code: proc.exitCode, signal: proc.signalCode })
      await cleanupNode(node)
      if (/no OCI runtime/i.test(log)) {
        return { skip: 'no OCI runtime works on this host: ' + log.trim().split('\n').pop() }
      }
      throw new Error(`aenv serve exited (${status}):\n${log}`)
    }
    try {
      const res = await fetch(url + '/health')
      if (res.status === 204) return node
    } catch {
      // not listening yet
    }
    await sleep(200)
  }
  await stopNode(node)
  throw new Error(`aenv serve did not become healthy within ${healthTimeoutMs / 1000} s:\n${log}`)
}

/**
 * Stop a node from startNode: SIGTERM, SIGKILL after 60 s; write its log to logFile if set;
 * remove what it leaves on the host (a stopped node keeps its bridge and nftables tables for
 * a restart to adopt; after a SIGKILL also netns, veths, cgroups and mounts) and its data dir.
 */
export async function stopNode(node, { keepDataDir = false } = {}) {
  if (!node || node.skip) return
  const { proc } = node
  const exited = () => proc.exitCode !== null || proc.signalCode !== null
  if (!exited()) {
    const gone = new Promise((res) => proc.once('exit', res))
    proc.kill('SIGTERM')
    let timer
    const stopped = await Promise.race([
      gone.then(() => true),
      new Promise((res) => { timer = setTimeout(res, 60_000, false) }),
    ])
    clearTimeout(timer)
    await sleep(100) // the last of its output
    if (!stopped) {
      proc.kill('SIGKILL')
      await gone
      console.error('aenv serve did not stop within 60 s of SIGTERM:\n' + node.log())
    }
  }
  if (node.logFile) writeFileSync(node.logFile, node.log())
  await cleanupNode(node, keepDataDir)
}

// cleanupNode removes the host resources of a node that is no longer running, all named
// after its own bridge, prefix and cgroup parent (nothing another node uses), then its data
// dir, asynchronously (hundreds of MB: the nodes of a cluster remove theirs at once).
// What it finds besides the bridge and nftables tables is reported on stderr.
async function cleanupNode({ net, dataDir, netns }, keepDataDir = false) {
  const found = []
  // Processes first (only after a SIGKILL are there any): the sandboxes' processes in the
  // node's cgroups, and the node's own helpers that outlived it (an orphaned `runc create`
  // names the data dir). Such a helper can hold the node's /dev/fuse descriptors, and while
  // one is open, unmounting the block roots below waits forever on a FUSE server that is gone.
  const cgDirs = []
  const walk = (d) => {
    let ents
    try { ents = readdirSync(d, { withFileTypes: true }) } catch { return }
    for (const e of ents) if (e.isDirectory()) walk(join(d, e.name))
    cgDirs.push(d) // children first
  }
  let hierarchies = []
  try { hierarchies = readdirSync('/sys/fs/cgroup') } catch {}
  const v2 = hierarchies.includes('cgroup.controllers')
  for (const h of v2 ? ['.'] : hierarchies) walk(join('/sys/fs/cgroup', h, net.cgroupParent))
  const killed = new Set()
  const kill = (pid) => {
    if (killed.has(pid) || pid === String(process.pid)) return
    killed.add(pid)
    try { process.kill(Number(pid), 'SIGKILL') } catch {}
  }
  for (const d of cgDirs) {
    let procs = ''
    try { procs = readFileSync(join(d, 'cgroup.procs'), 'utf8').trim() } catch {}
    if (!procs) continue
    for (const pid of procs.split('\n')) kill(pid)
    try { writeFileSync(join(d, 'freezer.state'), 'THAWED') } catch {}
    try { writeFileSync(join(d, 'cgroup.freeze'), '0') } catch {}
  }
  for (const pid of readdirSync('/proc').filter((e) => /^\d+$/.test(e))) {
    let cmdline = ''
    try { cmdline = readFileSync(`/proc/${pid}/cmdline`, 'utf8') } catch { continue }
    if (cmdline.split('\0').some((a) => a === dataDir || a.startsWith(dataDir + '/'))) kill(pid)
  }
  if (killed.size) {
    found.push(`killed processes ${[...killed].join(', ')}`)
    Atomics.wait(new Int32Array(new SharedArrayBuffer(4)), 0, 0, 500)
  }
  // Mounts and loop devices under the data dir before removing it: removing the dir through
  // a mount would reach into whatever is mounted there.
  const mounts = readFileSync('/proc/self/mountinfo', 'utf8').split('\n')
    .map((l) => l.split(' ')[4])
    .filter((m) => m && (m === dataDir || m.startsWith(dataDir + '/')))
    .map((m) => m.replace(/\\([0-7]{3})/g, (_, o) => String.fromCharCode(parseInt(o, 8))))
    .sort((a, b) => b.length - a.length)
  for (const m of mounts) {
    found.push('mount ' + m)
    run('umount', ['-l', m])
  }
  for (const line of (run('losetup', ['-a']) || '').split('\n')) {
    const m = line.match(/^(\/dev\/loop\d+):.*\((.*)\)$/)
    if (m && m[2].startsWith(dataDir + '/')) {
      found.push(`loop ${m[1]} (${m[2]})`)
      run('losetup', ['-d', m[1]])
    }
  }
  const sandboxCgroups = new Set(cgDirs.map((d) => d.split(net.cgroupParent + '/')[1]).filter(Boolean))
  if (sandboxCgroups.size) found.push('sandbox cgroups ' + [...sandboxCgroups].join(', '))
  // A cgroup whose last process was just killed is busy until the kernel has reaped it.
  const removeCgroup = (d) => {
    for (let i = 0; i < 50; i++) {
      try { rmdirSync(d); return } catch (err) {
        if (err.code === 'ENOENT') return
        if (i === 49) found.push(`cgroup ${d} not removed: ${err.code}`)
        else Atomics.wait(new Int32Array(new SharedArrayBuffer(4)), 0, 0, 100)
      }
    }
  }
  for (const d of cgDirs) removeCgroup(d)
  // The shared "aenv-e2e" parent, when no other node uses it any more.
  const top = net.cgroupParent.split('/')[0]
  for (const h of v2 ? ['.'] : hierarchies) {
    try { rmdirSync(join('/sys/fs/cgroup', h, top)) } catch {}
  }
  // The data plane's cgroup (internal/dataplane CgroupName: named after the data dir, in
  // the unified and systemd hierarchies), which its node removes only when it stops the
  // data plane itself; one killed above, or left serving a node stopped with sandboxes
  // running, leaves it.
  const plane = 'aenv.dataplane/' + createHash('sha256').update(resolve(dataDir)).digest('hex').slice(0, 12)
  for (const h of v2 ? ['.'] : hierarchies) {
    removeCgroup(join('/sys/fs/cgroup', h, plane))
    try { rmdirSync(join('/sys/fs/cgroup', h, 'aenv.dataplane')) } catch {}
  }
  // Network slots (netns "<prefix>-<i>", host veths "<prefix>h<i>"), then the bridge and the
  // nftables tables named after it (internal/network/nft.go: table inet <bridge>, table
  // bridge <bridge>).
  const slot = new RegExp(`^${net.prefix}-\\d+$`)
  for (const line of (run('ip', ['netns', 'list']) || '').split('\n')) {
    const name = line.split(' ')[0]
    if (slot.test(name)) {
      found.push('netns ' + name)
      run('ip', ['netns', 'del', name])
    }
  }
  // The node's host veths, bridge and tables are in its network namespace when it has one
  // (the host may have a bridge of the same name, another node's): looked for there.
  const inNs = (cmd, args) => (netns ? run('nsenter', [`--net=/run/netns/${netns}`, '--', cmd, ...args]) : run(cmd, args))
  const veth = new RegExp(`^${net.prefix}h\\d+$`)
  let links = []
  if (netns) {
    links = (inNs('ip', ['-o', 'link', 'show']) || '').split('\n').map((l) => (l.split(': ')[1] || '').split('@')[0])
  } else {
    try { links = readdirSync('/sys/class/net') } catch {}
  }
  for (const l of links) {
    if (veth.test(l)) {
      found.push('veth ' + l)
      inNs('ip', ['link', 'del', l])
    }
  }
  if (links.includes(net.bridge)) inNs('ip', ['link', 'del', net.bridge])
  const tables = (inNs('nft', ['list', 'tables']) || '').split('\n')
  for (const family of ['inet', 'bridge']) {
    if (tables.includes(`table ${family} ${net.bridge}`)) inNs('nft', ['delete', 'table', family, net.bridge])
  }
  // A microvm node's guest RAM files live in /dev/shm, in a directory named after its
  // backend's data dir (internal/sandbox/microvm Config.RAMDir); a node killed with SIGKILL
  // cannot remove it.
  if (!keepDataDir) {
    const ramDir = '/dev/shm/aenv-microvm-' + createHash('sha256').update(join(dataDir, 'microvm')).digest('hex').slice(0, 8)
    if (existsSync(ramDir)) {
      found.push('guest RAM dir ' + ramDir)
      rmSync(ramDir, { recursive: true, force: true })
    }
  }
  if (found.length) console.error(`aenv e2e: removed what node ${net.bridge} left behind:\n  ` + found.join('\n  '))
  if (!keepDataDir) await rm(dataDir, { recursive: true, force: true })
}

// ---------------------------------------------------------------------------------------------
// A cluster: `aenv scheduler`, `aenv gateway` and nodes (`aenv serve` registered with the
// scheduler), every one a process of its own.

/**
 * Run `aenv <args>` and wait up to 30 s until ready() resolves true. Returns {proc, log()}.
 */
export async function startDaemon(args, env, ready) {
  let log = ''
  const proc = spawn(join(binDir, 'aenv'), args, { env: { ...process.env, ...env }, stdio: ['ignore', 'pipe', 'pipe'] })
  proc.stdout.on('data', (d) => { log += d })
  proc.stderr.on('data', (d) => { log += d })
  const d = { proc, log: () => log }
  const deadline = Date.now() + 30_000
  while (Date.now() < deadline) {
    if (proc.exitCode !== null) throw new Error(`aenv ${args[0]} exited:\n${log}`)
    if (await ready().catch(() => false)) return d
    await sleep(100)
  }
  proc.kill('SIGKILL')
  throw new Error(`aenv ${args[0]} not ready within 30 s:\n${log}`)
}

// A test Kubernetes API server (bin/kubeapi-test: etcd and kube-apiserver from
// scripts/k8s-test-bins.sh) for scheduler replicas to elect a leader on.
const kubeAPIBin = join(binDir, 'kubeapi-test')
const repoRoot = resolve(here, '../..')

function kubeAssets() {
  try {
    return execFileSync(join(repoRoot, 'scripts', 'k8s-test-bins.sh'), ['dir'], { encoding: 'utf8' }).trim()
  } catch {
    return ''
  }
}

/** Why a test API server cannot run here, or ''. */
export function kubeAPIMissing() {
  if (!existsSync(kubeAPIBin)) return `no ${kubeAPIBin}: build it with \`make e2e\``
  const dir = kubeAssets()
  if (!dir || !existsSync(join(dir, 'kube-apiserver')) || !existsSync(join(dir, 'etcd'))) {
    return `no etcd and kube-apiserver in ${dir || 'the k8s assets dir'}: build them with \`make k8s-test-bins\``
  }
  return ''
}

/**
 * Start bin/kubeapi-test. Resolves {kubeconfig, proc, stop()} once its kubeconfig is
 * written. It stops its servers when its stdin closes, so a test process that dies takes
 * them with it.
 */
function startKubeAPI() {
  const dir = mkdtempSync(join(tmpdir(), 'aenv-e2e-kubeapi-'))
  const kubeconfig = join(dir, 'kubeconfig')
  let log = ''
  const proc = spawn(kubeAPIBin, ['-assets', kubeAssets(), '-write-kubeconfig', kubeconfig],
    { stdio: ['pipe', 'pipe', 'pipe'] })
  proc.stdout.on('data', (d) => { log += d })
  proc.stderr.on('data', (d) => { log += d })
  const k = {
    kubeconfig, proc, log: () => log,
    stop: async () => {
      if (proc.exitCode === null && proc.signalCode === null) {
        const exited = new Promise((res) => proc.once('exit', res))
        proc.stdin.end()
        const timer = setTimeout(() => proc.kill('SIGKILL'), 40_000)
        await exited
        clearTimeout(timer)
      }
      rmSync(dir, { recursive: true, force: true })
    },
  }
  k.ready = (async () => {
    const deadline = Date.now() + 120_000
    while (!existsSync(kubeconfig)) {
      if (proc.exitCode !== null) throw new Error(`kubeapi-test exited:\n${log}`)
      if (Date.now() > deadline) throw new Error(`kubeapi-test: no API server within 120 s:\n${log}`)
      await sleep(100)
    }
  })()
  k.ready.catch(() => {}) // awaited by the caller; this only keeps an early failure from being "unhandled"
  return k
}

/**
 * Start n `aenv scheduler` replicas on host electing a leader through a Lease on kube (the
 * lease short, so a killed leader is replaced within seconds), each with its metrics on
 * loopback: leaderOf tells which one leads. Each replica is {proc, log(), addr, metrics}.
 */
async function startSchedulerReplicas(kube, host, heartbeat, nodeIDs, n) {
  await kube.ready
  const lease = `aenv-e2e-${randomInt(1e9)}`
  const out = []
  for (let i = 0; i < n; i++) {
    const addr = `${host}:${await freePort()}`
    const metrics = `http://127.0.0.1:${await freePort()}/metrics`
    const d = await startDaemon(['scheduler', '--listen', addr, '--heartbeat-interval', heartbeat,
      '--kubeconfig', kube.kubeconfig, '--namespace', 'default', '--lease', lease,
      '--lease-duration', '4s', '--renew-deadline', '3s', '--retry-period', '250ms',
      '--nodes', nodeIDs.join(','), '--metrics-listen', new URL(metrics).host], {},
    async () => (await fetch(metrics)).ok)
    out.push(Object.assign(d, { addr, metrics }))
  }
  return out
}

/** The scheduler replica of c that reports itself leader, or null. */
export async function leaderOf(c) {
  for (const d of c.schedulers ?? []) {
    if (d.proc.exitCode !== null || d.proc.signalCode !== null) continue
    const text = await fetch(d.metrics).then((r) => r.text()).catch(() => '')
    if (/^aenv_scheduler_leader 1$/m.test(text)) return d
  }
  return null
}

/**
 * Start a scheduler (heartbeats every 500 ms: a node is stale 2.5 s after its last), a
 * gateway in front of it, and one node per entry of nodes ({id, tag, env, healthTimeoutMs}),
 * all sharing repoDir as their posix_fs repository (what lets a sandbox paused on one node
 * resume on another), then wait until every node is ready. A node's logFile gets its log when it stops.
 * With netns (root only) every node runs in a network namespace of its own on a test
 * bridge (testBridge), listening on its own address there; the scheduler listens on the
 * bridge and the gateway on loopback. With parallel the nodes start concurrently (faster on
 * a machine with spare cores; one at a time is gentler on a loaded one). Resolves to a cluster
 * {gateway, nodes, api(path, init), nodeOf(sandboxID), views(sandboxID), waitNodeState(node, state), stop()}
 * (with netns each node also has netns and ip) or {skip: reason} (stopped already) when a
 * node cannot run here. Give it to stop() in an after hook whatever happened (it is safe on
 * a partial cluster).
 */
export async function startCluster({
  apiKey, repoDir, nodes: specs, heartbeat = '500ms', netns = false, parallel = false, schedulers = 1,
}) {
  if (netns) {
    const missing = netnsMissing()
    if (missing) return { skip: missing, stop: async () => {} }
  }
  const c = { skip: '', gateway: '', nodes: [], daemons: [], bridge: null }
  c.api = async (path, init = {}) => {
    const r = await fetch(c.gateway + path, { ...init, headers: { 'x-api-key': apiKey, ...(init.headers || {}) } })
    return { status: r.status, body: await r.json().catch(() => null), headers: r.headers }
  }
  // nodeOf is the live node whose own API lists the sandbox running, else one that lists
  // it at all. A node that paused a sandbox another node has since claimed and resumed
  // lists it as paused until its next sync of hand-off records (about a second).
  c.nodeOf = async (id) => {
    let listed = null
    for (const n of c.nodes) {
      if (n.proc.exitCode !== null || n.proc.signalCode !== null) continue
      const r = await fetch(`${n.url}/sandboxes/${id}`, { headers: { 'x-api-key': apiKey } })
      if (r.status !== 200) {
        await r.body?.cancel()
        continue
      }
      if ((await r.json().catch(() => null))?.state === 'running') return n
      listed ??= n
    }
    return listed
  }
  // views is what each live node's own API says of sandbox id, for failure messages:
  // "node-a: 200 paused, node-b: 404".
  c.views = async (id) => {
    const out = []
    for (const n of c.nodes) {
      if (n.proc.exitCode !== null || n.proc.signalCode !== null) continue
      const r = await fetch(`${n.url}/sandboxes/${id}`, { headers: { 'x-api-key': apiKey } })
      const body = await r.json().catch(() => null)
      out.push(`${n.id}: ${r.status}${body?.state ? ' ' + body.state : ''}`)
    }
    return out.join(', ')
  }
  c.waitNodeState = async (node, state, timeoutMs = 30_000) => {
    const deadline = Date.now() + timeoutMs
    while (Date.now() < deadline) {
      const r = await c.api('/nodes')
      if (r.body?.find?.((n) => n.nodeID === node.id)?.state === state) return
      await sleep(100)
    }
    throw new Error(`node ${node.id} not ${state} within ${timeoutMs / 1000} s`)
  }
  c.stop = async () => {
    if (parallel) await Promise.all(c.nodes.map((n) => stopNode(n)))
    else for (const n of c.nodes) await stopNode(n)
    for (const d of c.daemons) d.proc.kill('SIGKILL')
    await c.kube?.stop()
    c.bridge?.remove()
  }
  try {
    if (netns) c.bridge = testBridge()
    if (schedulers > 1) {
      const missing = kubeAPIMissing()
      if (missing) c.schedulersSkip = missing
      else c.kube = startKubeAPI()
    }
    return await startClusterProcesses(c, { apiKey, repoDir, specs, heartbeat, parallel, schedulers })
  } catch (err) {
    await c.stop()
    throw err
  }
}

async function startClusterProcesses(c, { apiKey, repoDir, specs, heartbeat, parallel, schedulers }) {
  const host = c.bridge ? c.bridge.hostIP : '127.0.0.1'
  const gp = await freePort()
  c.gateway = `http://127.0.0.1:${gp}`
  let schedulerAddr
  if (c.kube) {
    // Replicas electing a leader through a Lease; nodes and the gateway are given all of them.
    c.schedulers = await startSchedulerReplicas(c.kube, host, heartbeat, specs.map((s) => s.id), schedulers)
    c.daemons.push(...c.schedulers)
    schedulerAddr = c.schedulers.map((d) => d.addr).join(',')
  } else {
    schedulerAddr = `${host}:${await freePort()}`
    // The scheduler has no HTTP endpoint: it is ready once the gateway's /health answers.
    c.daemons.push(await startDaemon(['scheduler', '--listen', schedulerAddr, '--heartbeat-interval', heartbeat], {},
      async () => true))
  }
  c.daemons.push(await startDaemon(['gateway', '--listen', `127.0.0.1:${gp}`, '--scheduler', schedulerAddr],
    { AENV_API_KEY: apiKey }, async () => (await fetch(c.gateway + '/health')).status === 204))
  const startOne = async ({ id, tag, env = {}, healthTimeoutMs, logFile }, i) => {
    const ns = c.bridge ? c.bridge.addNetns(i) : { name: '', ip: '127.0.0.1' }
    const n = await startNode({
      apiKey, tag, healthTimeoutMs, logFile, netns: ns.name, host: ns.ip,
      env: {
        AENV_CLUSTER_SCHEDULER: schedulerAddr, AENV_CLUSTER_NODE_ID: id,
        AENV_REPOSITORY_POSIX_FS_PATH: repoDir, AENV_SNAPSHOT_LAZY_LAYERS: 'true', AENV_SNAPSHOT_SYNC_INTERVAL: '1s',
        ...env,
      },
    })
    return Object.assign(n, { id, ip: ns.ip })
  }
  // Concurrently: every node is in c.nodes (so stop() stops it) before a failure is thrown.
  const results = parallel
    ? await Promise.allSettled(specs.map(startOne))
    : []
  for (const [i, spec] of specs.entries()) {
    if (!parallel) {
      try {
        results.push({ status: 'fulfilled', value: await startOne(spec, i) })
      } catch (reason) {
        results.push({ status: 'rejected', reason })
      }
    }
    const r = results[i]
    if (r.status === 'fulfilled' && !r.value.skip) c.nodes.push(r.value)
    if (!parallel && (r.status === 'rejected' || r.value.skip)) break
  }
  const failed = results.find((r) => r.status === 'rejected')
  if (failed) throw failed.reason
  const skipped = results.find((r) => r.value.skip)
  if (skipped) {
    await c.stop()
    return { skip: skipped.value.skip, stop: async () => {} }
  }
  for (let i = 0; i < 100; i++) {
    const r = await c.api('/nodes')
    if (r.status === 200 && r.body.filter((n) => n.state === 'ready').length === specs.length) break
    await sleep(100)
  }
  return c
}

/** Why nodes cannot run in network namespaces of their own here ('' when they can). */
export function netnsMissing() {
  if (!isRoot) return 'needs root (network namespaces, veths and a bridge for the nodes)'
  for (const [cmd, pkg] of [['ip', 'iproute2'], ['nsenter', 'util-linux']]) {
    try {
      execFileSync(cmd, ['-V'], { stdio: 'ignore' })
    } catch (err) {
      if (err.code === 'ENOENT') return `needs ${cmd} (Debian package ${pkg})`
    }
  }
  return ''
}

/**
 * A test bridge "aecn<K>" holding 10.214.K.1/24, K in 1..250 unique on the host (the Go
 * integration tests use 10.213.0.0/16 and "aitcn<K>"; nodes use 10.91.0.0/16 inside their
 * own namespaces). addNetns(i) makes namespace "aecn<K>-n<i>" whose eth0 (the peer of host
 * veth "aecn<K>v<i>", on the bridge) has 10.214.K.(10+i) and a default route via the
 * bridge, and returns {name, ip}. remove() deletes the namespaces, veths and the bridge;
 * call it after the processes in the namespaces are gone. Throws when ip fails.
 */
export function testBridge() {
  const used = new Set(Object.values(networkInterfaces()).flat().map((a) => a.address))
  let k = 0
  for (let i = 0; i < 100 && !k; i++) {
    const c = randomInt(1, 251)
    if (!existsSync(`/sys/class/net/aecn${c}`) && !used.has(`10.214.${c}.1`)) k = c
  }
  if (!k) throw new Error('no free test bridge name aecn<1..250>')
  const ip = (...args) => execFileSync('ip', args, { encoding: 'utf8', stdio: ['ignore', 'pipe', 'pipe'] })
  const br = {
    name: `aecn${k}`, hostIP: `10.214.${k}.1`, made: [],
    addNetns(i) {
      const name = `aecn${k}-n${i}`, veth = `aecn${k}v${i}`, addr = `10.214.${k}.${10 + i}`
      br.made.push({ name, veth })
      ip('netns', 'add', name)
      ip('link', 'add', veth, 'type', 'veth', 'peer', 'name', 'eth0', 'netns', name)
      ip('link', 'set', veth, 'master', br.name)
      ip('link', 'set', veth, 'up')
      ip('-n', name, 'link', 'set', 'lo', 'up')
      ip('-n', name, 'link', 'set', 'eth0', 'up')
      ip('-n', name, 'addr', 'add', `${addr}/24`, 'dev', 'eth0')
      ip('-n', name, 'route', 'add', 'default', 'via', br.hostIP)
      return { name, ip: addr }
    },
    remove() {
      for (const { name, veth } of br.made) {
        run('ip', ['link', 'del', veth])
        run('ip', ['netns', 'del', name])
      }
      run('ip', ['link', 'del', br.name])
    },
  }
  ip('link', 'add', br.name, 'type', 'bridge')
  try {
    ip('addr', 'add', `${br.hostIP}/24`, 'dev', br.name)
    ip('link', 'set', br.name, 'up')
  } catch (err) {
    br.remove()
    throw err
  }
  return br
}

/** Whether process pid runs in the named network namespace. */
export function inNetns(pid, name) {
  const a = statSync(`/proc/${pid}/ns/net`)
  const b = statSync(`/run/netns/${name}`)
  return a.dev === b.dev && a.ino === b.ino
}

// ---------------------------------------------------------------------------------------------
// microvm nodes (backend.kind = microvm: a QEMU microVM per sandbox, TCG here).

/** Why a microvm node cannot run here ('' when it can): root, QEMU, the guest (`make guest`). */
export function microvmMissing() {
  if (!isRoot) return 'needs root (taps, network namespaces, FUSE)'
  try {
    execFileSync('qemu-system-x86_64', ['--version'], { stdio: 'ignore' })
  } catch {
    return 'needs qemu-system-x86_64 (Debian package qemu-system-x86)'
  }
  for (const f of ['vmlinux', 'initrd.img']) {
    if (!existsSync(join(binDir, 'microvm', f))) return `needs the microVM guest (make guest): bin/microvm/${f} is missing`
  }
  return ''
}

/**
 * The environment of a microvm node on the posix_fs repository repoDir: 192 MiB guests
 * (touching memory under TCG is slow), 1 vCPU, a 1 s repository sync (a snapshot
 * published on one node appears on the other within seconds).
 */
export const microvmNodeEnv = (repoDir) => ({
  AENV_BACKEND_KIND: 'microvm',
  AENV_BACKEND_ACCEL: process.env.AENV_E2E_MICROVM_ACCEL || 'tcg',
  AENV_SANDBOX_DEFAULT_MEMORY_MB: '192',
  AENV_SANDBOX_DEFAULT_CPU: '1',
  AENV_REPOSITORY_POSIX_FS_PATH: repoDir,
  AENV_SNAPSHOT_SYNC_INTERVAL: '1s',
  // A cold boot under TCG on a busy 2-CPU machine can take tens of seconds.
  AENV_ENVD_READY_TIMEOUT: '180s',
})

// The counter lives in a background process's memory and advances once per poke (a line
// written to the FIFO /tmp/poke, which the counter holds open read-write, so a poke never
// blocks and is never lost): a restarted process would start again at 0, and the value at
// a snapshot or pause is exact, so whatever restores it must continue from it. /tmp/count
// is renamed into place (never read half-written). The command prints the counter's pid.
export const startCounter = `rm -f /tmp/poke /tmp/count; mkfifo /tmp/poke
setsid bash -c 'exec 3<>/tmp/poke; echo $$ > /tmp/counter.pid; i=0; echo $i > /tmp/count; while read x <&3; do i=$((i+1)); echo $i > /tmp/count.new; mv /tmp/count.new /tmp/count; done' >/dev/null 2>&1 </dev/null &
n=0; while [ ! -s /tmp/count ] && [ $n -lt 100 ]; do sleep 0.2; n=$((n+1)); done; cat /tmp/counter.pid`

/** poke advances the counter of sandbox sbx k times and returns {pid, value} once it has. */
export async function poke(sbx, k) {
  const r = await sbx.commands.run(`v=$(cat /tmp/count); for i in $(seq ${k}); do echo >> /tmp/poke; done
want=$((v+${k})); n=0; while [ "$(cat /tmp/count)" != "$want" ] && [ $n -lt 100 ]; do sleep 0.2; n=$((n+1)); done
p=$(cat /tmp/counter.pid); kill -0 $p && echo $p $(cat /tmp/count)`, { timeoutMs: 120_000 })
  const [pid, value] = r.stdout.trim().split(/\s+/)
  return { pid, value: Number(value) }
}

/** The median of xs. */
export function median(xs) {
  const s = [...xs].sort((a, b) => a - b)
  const m = s.length >> 1
  return s.length % 2 ? s[m] : (s[m - 1] + s[m]) / 2
}
