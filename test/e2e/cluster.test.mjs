// SDK end-to-end test of a cluster: the pinned e2b JS SDK against `aenv gateway` in front of
// two real nodes (`aenv serve --scheduler`) and `aenv scheduler`, every one a process of its
// own, started from ../../bin. The SDK is configured exactly as for one node
// (E2B_API_URL = E2B_SANDBOX_URL = the gateway). Skips, saying why, where a node cannot run.
import { test, before, after } from 'node:test'
import assert from 'node:assert/strict'
import { randomBytes } from 'node:crypto'
import { mkdtempSync, rmSync } from 'node:fs'
import { tmpdir } from 'node:os'
import { join } from 'node:path'

import { Sandbox, NotFoundError } from 'e2b'

import { startCluster } from './lib.mjs'

const apiKey = 'e2b_' + randomBytes(20).toString('hex')
const runId = randomBytes(4).toString('hex')

let skipReason = ''
let cluster = { stop: async () => {} }
let nodes = []
let api
// The nodes share a repository (a directory): what lets a sandbox paused on one resume on the other.
const repoDir = mkdtempSync(join(tmpdir(), 'aenv-e2e-cluster-repo-'))

before(async () => {
  cluster = await startCluster({
    apiKey, repoDir,
    nodes: ['e2e-node-a', 'e2e-node-b'].map((id) => ({ id, tag: 'aenv-e2e-cluster-' })),
  })
  if (cluster.skip) {
    skipReason = cluster.skip
    return
  }
  nodes = cluster.nodes
  api = cluster.api
  process.env.E2B_API_URL = cluster.gateway
  process.env.E2B_SANDBOX_URL = cluster.gateway
  process.env.E2B_API_KEY = apiKey
})

after(async () => {
  await cluster.stop()
  rmSync(repoDir, { recursive: true, force: true })
})

const nodeOf = (id) => cluster.nodeOf(id)

test('SDK through the gateway: create on both nodes, commands, files, list, pause, connect, kill', { timeout: 300_000 }, async (t) => {
  if (skipReason) return t.skip(skipReason)
  const { body: ns } = await api('/nodes')
  assert.deepEqual(ns.map((n) => n.nodeID).sort(), ['e2e-node-a', 'e2e-node-b'])

  const metadata = { suite: runId }
  const sbxs = []
  try {
    for (let i = 0; i < 4; i++) sbxs.push(await Sandbox.create({ metadata, timeoutMs: 120_000 }))
    // Placement spread them: each node runs some (asked directly, not through the gateway).
    for (const n of nodes) {
      const r = await fetch(`${n.url}/v2/sandboxes`, { headers: { 'x-api-key': apiKey } })
      assert.ok((await r.json()).length >= 1, `node ${n.url} runs none of the 4 sandboxes`)
    }
    const [a, b] = sbxs
    const hi = await a.commands.run('echo hi')
    assert.equal(hi.stdout, 'hi\n')
    await b.files.write('/home/user/x.txt', 'through the gateway')
    assert.equal(await b.files.read('/home/user/x.txt'), 'through the gateway')
    const url = await b.downloadUrl('/home/user/x.txt')
    assert.equal(await (await fetch(url)).text(), 'through the gateway')

    // Listed once each, across both nodes, with paging.
    const paginator = Sandbox.list({ query: { metadata }, limit: 3 })
    const seen = []
    while (paginator.hasNext) seen.push(...(await paginator.nextItems()).map((s) => s.sandboxId))
    assert.deepEqual(seen.sort(), sbxs.map((s) => s.sandboxId).sort())

    await a.pause()
    const again = await Sandbox.connect(a.sandboxId)
    assert.equal((await again.commands.run('echo back')).stdout, 'back\n')

    await b.kill()
    await assert.rejects(Sandbox.connect(b.sandboxId), NotFoundError)
  } finally {
    for (const s of sbxs) await Sandbox.kill(s.sandboxId).catch(() => {})
  }
})

// Last: it kills a node. A sandbox paused to disk on one node (E2B's pause with memory:false)
// is resumed by Sandbox.connect through the gateway on the other node once its node is killed
// with SIGKILL: same id, its files, commands work.
test('SDK through the gateway: a sandbox paused on a node that dies resumes on the other node', { timeout: 300_000 }, async (t) => {
  if (skipReason) return t.skip(skipReason)
  const sbx = await Sandbox.create({ timeoutMs: 120_000 })
  try {
    await sbx.files.write('/home/user/moved.txt', 'kept across nodes')
    const a = await nodeOf(sbx.sandboxId)
    assert.ok(a, 'no node lists the new sandbox')
    const p = await api(`/sandboxes/${sbx.sandboxId}/pause`, {
      method: 'POST', headers: { 'content-type': 'application/json' }, body: JSON.stringify({ memory: false }),
    })
    assert.equal(p.status, 204, JSON.stringify(p.body))

    const gone = new Promise((res) => a.proc.once('exit', res))
    a.proc.kill('SIGKILL')
    await gone
    // The scheduler calls a node stale after 5 heartbeat intervals (2.5 s here).
    await cluster.waitNodeState(a, 'stale')
    const start = Date.now()
    const moved = await Sandbox.connect(sbx.sandboxId, { timeoutMs: 120_000 })
    t.diagnostic(`resume on the other node: ${Date.now() - start} ms`)
    assert.equal(moved.sandboxId, sbx.sandboxId)
    const b = await nodeOf(sbx.sandboxId)
    assert.ok(b && b !== a, 'the sandbox is not on the surviving node')
    assert.equal(await moved.files.read('/home/user/moved.txt'), 'kept across nodes')
    assert.equal((await moved.commands.run('echo moved')).stdout, 'moved\n')
  } finally {
    await Sandbox.kill(sbx.sandboxId).catch(() => {})
  }
})
