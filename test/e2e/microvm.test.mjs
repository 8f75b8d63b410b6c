// SDK end-to-end test of the microvm backend: the pinned e2b JS SDK (2.51.0) against two
// `aenv serve` nodes with backend.kind = microvm (a QEMU microVM per sandbox, TCG here)
// sharing one posix_fs repository. What the backend adds over containers is checked through
// the SDK: a background process survives pause/resume, and every fork of a snapshot
// continues it from the same value with its memory; a snapshot taken on node A starts, with
// its processes, on node B. Guests are 192 MiB (touching memory under TCG is slow).
// It skips, saying why, when not root or when QEMU or the guest (`make guest`) is missing.
import { test, before, after } from 'node:test'
import assert from 'node:assert/strict'
import { randomBytes } from 'node:crypto'
import { mkdtempSync, rmSync } from 'node:fs'
import { execFileSync } from 'node:child_process'
import { tmpdir } from 'node:os'
import { join } from 'node:path'

import { Sandbox } from 'e2b'

import {
  startNode, stopNode, sleep, microvmMissing, microvmNodeEnv, startCounter, poke,
} from './lib.mjs'

const apiKey = 'e2b_' + randomBytes(20).toString('hex')
const runId = randomBytes(4).toString('hex')

let skipReason = ''
let repoDir = ''
const nodes = [] // [A, B]

// Sandboxes live 4 min; SDK requests (a create, a fork) may take as long as a boot.
const slow = { timeoutMs: 240_000, requestTimeoutMs: 240_000 }

before(async () => {
  skipReason = microvmMissing()
  if (skipReason) return
  repoDir = mkdtempSync(join(tmpdir(), 'aenv-e2e-mvrepo-'))
  for (const tag of ['aenv-e2e-mva-', 'aenv-e2e-mvb-']) {
    const n = await startNode({ apiKey, tag, env: microvmNodeEnv(repoDir), healthTimeoutMs: 300_000 })
    if (n.skip) {
      skipReason = n.skip
      return
    }
    nodes.push(n)
  }
  process.env.E2B_API_URL = nodes[0].url
  process.env.E2B_SANDBOX_URL = nodes[0].url
  process.env.E2B_API_KEY = apiKey
})

after(async () => {
  for (const n of nodes) await stopNode(n)
  if (repoDir) rmSync(repoDir, { recursive: true, force: true })
})

// on(n) are the SDK options that talk to node n.
const on = (n) => ({ apiKey, apiUrl: n.url, sandboxUrl: n.url, requestTimeoutMs: 240_000 })

test('GET /aenv/capabilities: the microvm backend keeps processes and memory', async (t) => {
  if (skipReason) return t.skip(skipReason)
  const res = await fetch(nodes[0].url + '/aenv/capabilities', { headers: { 'X-API-Key': apiKey } })
  assert.equal(res.status, 200)
  const caps = await res.json()
  assert.equal(caps.backend, 'microvm')
  assert.equal(caps.snapshots, true)
  assert.equal(caps.memorySnapshots, true)
  assert.equal(caps.pauseKeepsProcesses, true)
  assert.equal(caps.liveFork, true)
})

test('create, commands, files; pause and resume keep a background process', { timeout: 300_000 }, async (t) => {
  if (skipReason) return t.skip(skipReason)
  const sbx = await Sandbox.create(slow)
  try {
    const r = await sbx.commands.run('uname -r; echo hi from $(hostname)')
    assert.match(r.stdout, /hi from /)
    assert.notEqual(r.stdout.split('\n')[0], execFileSync('uname', ['-r'], { encoding: 'utf8' }).trim(),
      'the guest runs a kernel of its own')
    await sbx.files.write('/home/user/note.txt', 'kept')
    assert.equal(await sbx.files.read('/home/user/note.txt'), 'kept')

    const pid = (await sbx.commands.run(startCounter)).stdout.trim()
    const before = await poke(sbx, 3)
    assert.deepEqual(before, { pid, value: 3 })

    await sbx.pause({ requestTimeoutMs: 240_000 })
    assert.equal((await sbx.getInfo()).state, 'paused')
    const back = await Sandbox.connect(sbx.sandboxId, slow)
    assert.deepEqual(await poke(back, 1), { pid, value: 4 }, 'the counter process continued with its memory')
    assert.equal(await back.files.read('/home/user/note.txt'), 'kept')
  } finally {
    await Sandbox.kill(sbx.sandboxId).catch(() => {})
  }
})

test('snapshot + fork 4: every fork continues the counter from the same value, then on its own', { timeout: 300_000 }, async (t) => {
  if (skipReason) return t.skip(skipReason)
  const sbx = await Sandbox.create(slow)
  const started = [sbx]
  try {
    const pid = (await sbx.commands.run(startCounter)).stdout.trim()
    assert.equal((await poke(sbx, 5)).value, 5)
    const forks = await sbx.fork({ count: 4, ...slow })
    assert.equal(forks.length, 4)
    for (const [i, f] of forks.entries()) {
      assert.ok(f instanceof Sandbox, `fork ${i}: ${f}`)
      started.push(f)
    }
    // Each fork: the same process, at 5, so one poke makes 6; then i more pokes and a file
    // of its own, which no other fork (nor the source) sees.
    for (const [i, f] of forks.entries()) {
      assert.deepEqual(await poke(f, 1), { pid, value: 6 }, `fork ${i}`)
      await poke(f, i + 1)
      await f.files.write('/home/user/mine.txt', `fork ${i}`)
    }
    for (const [i, f] of forks.entries()) {
      assert.equal((await f.commands.run('cat /tmp/count')).stdout.trim(), String(7 + i), `fork ${i} counted alone`)
      assert.equal(await f.files.read('/home/user/mine.txt'), `fork ${i}`)
    }
    assert.deepEqual(await poke(sbx, 1), { pid, value: 6 }, 'the source counted alone')
    await assert.rejects(sbx.files.read('/home/user/mine.txt'))
  } finally {
    for (const s of started) await Sandbox.kill(s.sandboxId).catch(() => {})
  }
})

test('a snapshot taken on node A starts on node B with its processes, through the repository', { timeout: 300_000 }, async (t) => {
  if (skipReason) return t.skip(skipReason)
  const [a, b] = nodes
  const sbx = await Sandbox.create({ ...on(a), timeoutMs: 240_000 })
  const started = []
  try {
    const pid = (await sbx.commands.run(startCounter)).stdout.trim()
    assert.equal((await poke(sbx, 2)).value, 2)
    await sbx.files.write('/home/user/from.txt', 'node A')
    const name = 'mv-' + runId
    const snap = await sbx.createSnapshot({ name })
    // Published in the background; node B syncs every second once it is complete.
    const t0 = Date.now()
    let child
    for (;;) {
      try {
        child = await Sandbox.create(snap.snapshotId, { ...on(b), timeoutMs: 240_000 })
        break
      } catch (err) {
        if (!/404|not found/i.test(err.message) || Date.now() - t0 > 180_000) throw err
        await sleep(500)
      }
    }
    started.push(child)
    t.diagnostic(`snapshot on A → its sandbox on B answering: ${Date.now() - t0} ms (publication, sync, fetch, restore)`)
    assert.deepEqual(await poke(child, 1), { pid, value: 3 }, 'A\'s counter process continues on B')
    assert.equal(await child.files.read('/home/user/from.txt'), 'node A')
    const list = await (await fetch(b.url + '/sandboxes', { headers: { 'X-API-Key': apiKey } })).json()
    assert.ok(list.some((s) => s.sandboxID === child.sandboxId), 'the child runs on node B')
  } finally {
    await Sandbox.kill(sbx.sandboxId, on(a)).catch(() => {})
    for (const s of started) await Sandbox.kill(s.sandboxId, on(b)).catch(() => {})
  }
})
