// SDK end-to-end test of a cluster of microvm nodes: the pinned e2b JS SDK against `aenv
// gateway` in front of `aenv scheduler` and two `aenv serve` nodes with backend.kind =
// microvm (a QEMU microVM per sandbox, TCG here) sharing a posix_fs repository, every one a
// process of its own. A microVM's pause is a memory image; in a cluster it is published
// (layers, RAM, device state and the sandbox's record) before the pause returns, so when its
// node is drained or killed with SIGKILL, Sandbox.connect through the gateway resumes the
// sandbox on the other node with its processes and their memory: a counter process goes on
// from its value, under the same sandbox id and envd token. Guests are 192 MiB. It reports
// (t.diagnostic) the medians of SDK pause, resume on the other node, and create → first
// command from a snapshot. It skips, saying why, when not root or when QEMU or the guest
// (`make guest`) is missing.
import { test, before, after } from 'node:test'
import assert from 'node:assert/strict'
import { randomBytes } from 'node:crypto'
import { mkdtempSync, rmSync } from 'node:fs'
import { tmpdir } from 'node:os'
import { join } from 'node:path'

import { Sandbox } from 'e2b'

import {
  startCluster, microvmMissing, microvmNodeEnv, startCounter, poke, median,
} from './lib.mjs'

const apiKey = 'e2b_' + randomBytes(20).toString('hex')
const runId = randomBytes(4).toString('hex')

let skipReason = ''
let repoDir = ''
let cluster = { stop: async () => {} }

// Sandboxes live 4 min; SDK requests (a create, a resume) may take as long as a boot.
const slow = { timeoutMs: 240_000, requestTimeoutMs: 240_000 }

before(async () => {
  skipReason = microvmMissing()
  if (skipReason) return
  repoDir = mkdtempSync(join(tmpdir(), 'aenv-e2e-mvcluster-repo-'))
  cluster = await startCluster({
    apiKey, repoDir,
    nodes: ['mv-node-a', 'mv-node-b'].map((id) => ({
      id, tag: 'aenv-e2e-mvcluster-', env: microvmNodeEnv(repoDir), healthTimeoutMs: 300_000,
      // AENV_E2E_LOG_DIR=dir keeps each node's log there.
      logFile: process.env.AENV_E2E_LOG_DIR ? join(process.env.AENV_E2E_LOG_DIR, `${id}.log`) : '',
    })),
  })
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
  if (repoDir) rmSync(repoDir, { recursive: true, force: true })
})

// envdStatus is the status of envd's GET /envs (it needs the sandbox's token) through the
// gateway, routed by header.
async function envdStatus(id, token) {
  const r = await fetch(`${cluster.gateway}/envs`, {
    headers: { 'e2b-sandbox-id': id, 'e2b-sandbox-port': '49983', 'x-access-token': token },
  })
  await r.body?.cancel()
  return r.status
}

// drain drains (or undrains) node n through the gateway.
async function drain(n, draining) {
  const r = await cluster.api(`/nodes/${n.id}/${draining ? 'drain' : 'undrain'}`, { method: 'POST' })
  assert.equal(r.status, 200, JSON.stringify(r.body))
  await cluster.waitNodeState(n, draining ? 'draining' : 'ready')
}

// moved checks that sbx (resumed from src) runs on another node with the counter process
// pid at want and its files, and that envd takes the sandbox's token and no other.
async function checkMoved(sbx, src, { pid, want, token, files }) {
  const dst = await cluster.nodeOf(sbx.sandboxId)
  if (!dst || dst === src) {
    assert.fail(`the sandbox is not on the other node (on ${dst?.id}; the nodes say ${await cluster.views(sbx.sandboxId)})`)
  }
  assert.deepEqual(await poke(sbx, 1), { pid, value: want }, 'the counter process continued with its memory')
  for (const [path, content] of Object.entries(files)) assert.equal(await sbx.files.read(path), content)
  assert.equal(await envdStatus(sbx.sandboxId, token), 200)
  assert.equal(await envdStatus(sbx.sandboxId, token + 'x'), 401)
  return dst
}

// stageStats sums aenv_sandbox_stage_duration_seconds of operation op over the live nodes:
// {sum: {stage: seconds}, count: {stage: n}}.
async function stageStats(op) {
  const st = { sum: {}, count: {} }
  for (const n of cluster.nodes) {
    if (n.proc.exitCode !== null || n.proc.signalCode !== null) continue
    const text = await (await fetch(n.url + '/metrics')).text()
    for (const line of text.split('\n')) {
      const m = line.match(/^aenv_sandbox_stage_duration_seconds_(sum|count)\{(.*)\} (\S+)$/)
      if (!m || !m[2].includes(`operation="${op}"`)) continue
      const stage = m[2].match(/stage="([^"]+)"/)?.[1]
      st[m[1]][stage] = (st[m[1]][stage] || 0) + Number(m[3])
    }
  }
  return st
}

// stageMeans is the mean duration in ms of each stage of operation op on the live nodes
// since the stats since (from stageStats), e.g. {pause: 812, handoff: 2900, total: 3800}.
async function stageMeans(op, since = { sum: {}, count: {} }) {
  const now = await stageStats(op)
  const out = {}
  for (const k of Object.keys(now.sum)) {
    const n = now.count[k] - (since.count[k] || 0)
    if (n > 0) out[k] = Math.round(((now.sum[k] - (since.sum[k] || 0)) / n) * 1000)
  }
  return out
}

test('create → first command from a snapshot through the gateway', { timeout: 600_000 }, async (t) => {
  if (skipReason) return t.skip(skipReason)
  const src = await Sandbox.create(slow)
  const started = []
  try {
    await src.commands.run(startCounter)
    const snap = await src.createSnapshot({ name: 'mvc-' + runId })
    const ms = []
    const where = []
    const since = await stageStats('create')
    for (let i = 0; i < 3; i++) {
      // Until the snapshot is published and synced, only its own node knows it: the
      // gateway sends a create the other node refuses (404) to the node that has it.
      const t0 = Date.now()
      const s = await Sandbox.create(snap.snapshotId, slow)
      started.push(s)
      assert.equal((await s.commands.run('cat /tmp/count')).stdout.trim(), '0')
      ms.push(Date.now() - t0)
      where.push((await cluster.nodeOf(s.sandboxId))?.id)
    }
    t.diagnostic(`create from a snapshot → first command: median ${median(ms)} ms (${ms.join(', ')}; on ${where.join(', ')}; ` +
      `snapshot taken on ${(await cluster.nodeOf(src.sandboxId))?.id})`)
    t.diagnostic(`mean ms per stage on the nodes: create ${JSON.stringify(await stageMeans('create', since))}`)
  } finally {
    for (const s of [src, ...started]) await Sandbox.kill(s.sandboxId).catch(() => {})
  }
})

test('a sandbox paused on a drained node resumes with its processes and memory on the other, three times', { timeout: 900_000 }, async (t) => {
  if (skipReason) return t.skip(skipReason)
  let sbx = await Sandbox.create(slow)
  const id = sbx.sandboxId
  const token = sbx.envdAccessToken
  assert.ok(token, 'the sandbox has an envd token')
  const pauses = []
  const resumes = []
  let drained = null
  try {
    const pid = (await sbx.commands.run(startCounter)).stdout.trim()
    assert.deepEqual(await poke(sbx, 2), { pid, value: 2 })
    const since = { pause: await stageStats('pause'), resume: await stageStats('resume') }
    const files = { '/home/user/first.txt': 'written on the first node' }
    await sbx.files.write('/home/user/first.txt', files['/home/user/first.txt'])
    for (let i = 0; i < 3; i++) {
      const src = await cluster.nodeOf(id)
      assert.ok(src, 'no node lists the sandbox')
      let t0 = Date.now()
      await sbx.pause({ requestTimeoutMs: 240_000 })
      pauses.push(Date.now() - t0)
      assert.equal((await Sandbox.getInfo(id)).state, 'paused')
      // Drained: no resume there; the paused sandbox is already published.
      await drain(src, true)
      drained = src
      t0 = Date.now()
      sbx = await Sandbox.connect(id, slow)
      resumes.push(Date.now() - t0)
      assert.equal(sbx.sandboxId, id)
      assert.equal(sbx.envdAccessToken, token, 'the same envd token')
      await checkMoved(sbx, src, { pid, want: 3 + i, token, files })
      const f = `/home/user/move-${i}.txt`
      files[f] = `after move ${i}`
      await sbx.files.write(f, files[f])
      await drain(src, false)
      drained = null
    }
    t.diagnostic(`SDK pause (memory image published): median ${median(pauses)} ms (${pauses.join(', ')})`)
    t.diagnostic(`Sandbox.connect → resumed on the other node: median ${median(resumes)} ms (${resumes.join(', ')})`)
    t.diagnostic(`mean ms per stage on the nodes: pause ${JSON.stringify(await stageMeans('pause', since.pause))}, ` +
      `resume ${JSON.stringify(await stageMeans('resume', since.resume))}`)
  } finally {
    if (drained) await drain(drained, false).catch(() => {})
    await Sandbox.kill(id).catch(() => {})
  }
})

// Last: it kills a node.
test('a sandbox paused on a node killed with SIGKILL resumes with its processes on the other node', { timeout: 600_000 }, async (t) => {
  if (skipReason) return t.skip(skipReason)
  const sbx = await Sandbox.create(slow)
  const id = sbx.sandboxId
  try {
    const pid = (await sbx.commands.run(startCounter)).stdout.trim()
    assert.deepEqual(await poke(sbx, 4), { pid, value: 4 })
    await sbx.files.write('/home/user/moved.txt', 'kept across nodes')
    const a = await cluster.nodeOf(id)
    assert.ok(a, 'no node lists the new sandbox')
    await sbx.pause({ requestTimeoutMs: 240_000 })

    const gone = new Promise((res) => a.proc.once('exit', res))
    a.proc.kill('SIGKILL')
    await gone
    await cluster.waitNodeState(a, 'stale')
    const t0 = Date.now()
    const moved = await Sandbox.connect(id, slow)
    t.diagnostic(`resume on the other node after a SIGKILL: ${Date.now() - t0} ms`)
    assert.equal(moved.sandboxId, id)
    await checkMoved(moved, a, {
      pid, want: 5, token: sbx.envdAccessToken, files: { '/home/user/moved.txt': 'kept across nodes' },
    })
    assert.equal((await moved.commands.run('echo moved')).stdout, 'moved\n')
  } finally {
    await Sandbox.kill(id).catch(() => {})
  }
})
