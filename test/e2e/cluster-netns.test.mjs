// SDK end-to-end test of a cluster whose nodes each run in a network namespace of their own:
// the pinned e2b JS SDK against `aenv gateway` (on loopback) in front of two `aenv scheduler`
// replicas (on a test bridge, electing a leader through a Lease on a test Kubernetes API
// server, bin/kubeapi-test) and three `aenv serve --scheduler` nodes, each in its own
// namespace with its own address on the bridge, every one a process of its own started from
// ../../bin. The SDK is configured exactly as for one node (E2B_API_URL = E2B_SANDBOX_URL =
// the gateway), so its envd traffic (commands, streams, files, watches) reaches the nodes
// only through the gateway. It reports (t.diagnostic) the cluster's start and the scenario's
// steps. Skips, saying why, when not root or when a node cannot run here; without the
// Kubernetes test binaries it runs with one scheduler and skips the leader-kill test.
import { test, before, after } from 'node:test'
import assert from 'node:assert/strict'
import { randomBytes } from 'node:crypto'
import { mkdtempSync, rmSync } from 'node:fs'
import { tmpdir } from 'node:os'
import { join } from 'node:path'

import { Sandbox, NotFoundError, AuthenticationError, FilesystemEventType } from 'e2b'

import { startCluster, inNetns, sleep, leaderOf } from './lib.mjs'

const apiKey = 'e2b_' + randomBytes(20).toString('hex')
const runId = randomBytes(4).toString('hex')
const ids = ['e2e-ns-a', 'e2e-ns-b', 'e2e-ns-c']

let skipReason = ''
let cluster = { stop: async () => {} }
let startMs = 0
// The nodes share a repository (a directory): what lets a sandbox paused on one resume on another.
const repoDir = mkdtempSync(join(tmpdir(), 'aenv-e2e-nscluster-repo-'))

before(async () => {
  const start = Date.now()
  cluster = await startCluster({
    apiKey, repoDir, netns: true, parallel: true, schedulers: 2,
    nodes: ids.map((id) => ({ id, tag: 'aenv-e2e-nscluster-' })),
  })
  startMs = Date.now() - start
  if (cluster.skip) {
    skipReason = cluster.skip
    return
  }
  process.env.E2B_API_URL = cluster.gateway
  process.env.E2B_SANDBOX_URL = cluster.gateway
  process.env.E2B_API_KEY = apiKey
})

after(async () => {
  await cluster.stop()
  rmSync(repoDir, { recursive: true, force: true })
})

// step runs fn and reports how long it took.
async function step(t, what, fn) {
  const start = Date.now()
  const out = await fn()
  t.diagnostic(`${what}: ${Date.now() - start} ms`)
  return out
}

test('SDK through the gateway to nodes in their own network namespaces', { timeout: 300_000 }, async (t) => {
  if (skipReason) return t.skip(skipReason)
  t.diagnostic(`cluster of 3 nodes in namespaces started in ${startMs} ms`)
  // Every node runs in its namespace and registered its own address there.
  const { body: ns } = await cluster.api('/nodes')
  for (const n of cluster.nodes) {
    assert.ok(inNetns(n.proc.pid, n.netns), `node ${n.id} does not run in namespace ${n.netns}`)
    const reg = ns.find((r) => r.nodeID === n.id)
    assert.equal(reg?.endpoint, n.url, `node ${n.id} registered ${reg?.endpoint}, want its own address`)
    assert.equal(reg.state, 'ready')
  }
  assert.equal(new Set(cluster.nodes.map((n) => n.ip)).size, 3)

  // A wrong API key is refused by the gateway, for creates and for lists.
  const wrong = 'e2b_' + randomBytes(20).toString('hex')
  await assert.rejects(Sandbox.create({ apiKey: wrong }), AuthenticationError)
  await assert.rejects(Sandbox.list({ apiKey: wrong }).nextItems(), AuthenticationError)

  const metadata = { suite: runId }
  const sbxs = []
  try {
    // Three creates at once land on at least two nodes (asked directly, not through the gateway).
    sbxs.push(...await step(t, '3 concurrent Sandbox.create', () =>
      Promise.all([0, 1, 2].map(() => Sandbox.create({ metadata, timeoutMs: 120_000 })))))
    const on = new Map()
    for (const s of sbxs) {
      const n = await cluster.nodeOf(s.sandboxId)
      assert.ok(n, `no node lists ${s.sandboxId}`)
      on.set(s.sandboxId, n)
    }
    const used = new Set([...on.values()].map((n) => n.id))
    t.diagnostic(`placement: ${[...on.values()].map((n) => n.id).join(', ')}`)
    assert.ok(used.size >= 2, `3 creates on 3 idle nodes all went to ${[...used]}`)
    // a and b on different nodes.
    const a = sbxs[0]
    const b = sbxs.find((s) => on.get(s.sandboxId) !== on.get(a.sandboxId))

    // Commands: one that returns, one in the background streaming its output.
    const hi = await a.commands.run('echo hi from $(hostname)')
    assert.match(hi.stdout, /^hi from /)
    const out = []
    const bg = await b.commands.run('for i in 1 2 3; do echo line$i; sleep 0.1; done', {
      background: true, onStdout: (d) => out.push(d),
    })
    const done = await bg.wait()
    assert.equal(done.exitCode, 0)
    assert.equal(out.join(''), 'line1\nline2\nline3\n')

    // Files: a watch sees a write; write, read, list.
    await b.files.makeDir('/home/user/w')
    const events = []
    const w = await b.files.watchDir('/home/user/w', (e) => events.push(e))
    await b.files.write('/home/user/w/x.txt', 'through the gateway')
    for (let i = 0; i < 50 && !events.some((e) => e.name === 'x.txt'); i++) await sleep(100)
    await w.stop()
    assert.ok(events.some((e) => e.name === 'x.txt' && [FilesystemEventType.CREATE, FilesystemEventType.WRITE].includes(e.type)),
      `watch saw ${JSON.stringify(events)}`)
    assert.equal(await b.files.read('/home/user/w/x.txt'), 'through the gateway')
    assert.deepEqual((await b.files.list('/home/user/w')).map((e) => e.name), ['x.txt'])

    // Listed once each across the nodes, with paging.
    const seen = await step(t, 'Sandbox.list over 3 nodes, pages of 2', async () => {
      const paginator = Sandbox.list({ query: { metadata }, limit: 2 })
      const ids = []
      while (paginator.hasNext) ids.push(...(await paginator.nextItems()).map((s) => s.sandboxId))
      return ids
    })
    assert.deepEqual(seen.sort(), sbxs.map((s) => s.sandboxId).sort())

    // setTimeout moves the end through the gateway.
    const before = (await a.getInfo()).endAt.getTime()
    await a.setTimeout(600_000)
    const endAt = (await a.getInfo()).endAt.getTime()
    // (a second of slack: the node may round the end to its clock's second)
    assert.ok(endAt > before && endAt <= Date.now() + 601_000, `endAt ${new Date(endAt).toISOString()} after setTimeout(600 s)`)

    // Pause, then connect resumes it (on whichever node the gateway picks) with its files.
    await a.files.write('/home/user/kept.txt', 'kept')
    await step(t, 'pause', () => a.pause())
    const again = await step(t, 'connect (resume)', () => Sandbox.connect(a.sandboxId))
    assert.equal(await again.files.read('/home/user/kept.txt'), 'kept')
    assert.equal((await again.commands.run('echo back')).stdout, 'back\n')

    await b.kill()
    await assert.rejects(Sandbox.connect(b.sandboxId), NotFoundError)
    const left = await Sandbox.list({ query: { metadata } }).nextItems()
    assert.ok(!left.some((s) => s.sandboxId === b.sandboxId), 'a killed sandbox is still listed')
  } finally {
    for (const s of sbxs) await Sandbox.kill(s.sandboxId).catch(() => {})
  }
})

// The scheduler leader dies (SIGKILL: it cannot release its Lease). The other replica
// takes the Lease and rebuilds its state from the nodes' heartbeats; meanwhile and after,
// the SDK reaches a sandbox made before the kill and creates new ones through the gateway.
test('SDK through the gateway survives the scheduler leader being killed', { timeout: 180_000 }, async (t) => {
  if (skipReason) return t.skip(skipReason)
  if (cluster.schedulersSkip) return t.skip(cluster.schedulersSkip)
  const metadata = { suite: runId, step: 'failover' }
  const sbxs = []
  try {
    const old = await Sandbox.create({ metadata, timeoutMs: 120_000 })
    sbxs.push(old)
    await old.files.write('/home/user/before.txt', 'before the kill')
    let leader = null
    for (let i = 0; i < 100 && !leader; i++) {
      leader = await leaderOf(cluster)
      if (!leader) await sleep(100)
    }
    assert.ok(leader, 'no scheduler replica reports itself leader')
    const start = Date.now()
    leader.proc.kill('SIGKILL')
    let next = null
    while (Date.now() - start < 30_000) {
      next = await leaderOf(cluster)
      if (next) break
      await sleep(100)
    }
    assert.ok(next && next !== leader, 'no other replica took the Lease within 30 s')
    t.diagnostic(`leader killed: the other replica leads after ${Date.now() - start} ms (lease 4 s)`)

    // A sandbox made before the kill: found, and its envd answers, through the gateway.
    const again = await step(t, 'connect to a sandbox made before the kill', () => Sandbox.connect(old.sandboxId))
    assert.equal(await again.files.read('/home/user/before.txt'), 'before the kill')
    assert.equal((await again.commands.run('echo still here')).stdout, 'still here\n')
    // New creates are placed by the new leader.
    const fresh = await step(t, 'Sandbox.create after the kill', () => Sandbox.create({ metadata, timeoutMs: 120_000 }))
    sbxs.push(fresh)
    assert.equal((await fresh.commands.run('echo new')).stdout, 'new\n')
    const listed = (await Sandbox.list({ query: { metadata } }).nextItems()).map((s) => s.sandboxId).sort()
    assert.deepEqual(listed, sbxs.map((s) => s.sandboxId).sort())
  } finally {
    for (const s of sbxs) await Sandbox.kill(s.sandboxId).catch(() => {})
  }
})
