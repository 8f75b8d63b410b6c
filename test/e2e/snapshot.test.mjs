// SDK end-to-end test of snapshots, fork and pause to disk: the pinned e2b JS SDK (2.51.0)
// against a real `aenv serve` in single-server mode, exactly as serve.test.mjs starts it.
//
// What runs depends on the node's backend, read from GET /aenv/capabilities:
//   - snapshots: true  → the full flow (createSnapshot, listSnapshots, create from a snapshot
//     by id and by name, fork, pause with keepMemory:false and connect, deleteSnapshot),
//     skipped with the server's message when it answers 501 for the base template's sandbox;
//   - snapshots: false → the full flow is skipped ("OCI backend snapshot not yet available").
// Wherever the base template's sandbox cannot be snapshotted, the documented answer is
// checked instead: 501 for snapshot and fork, pause with keepMemory:false still pausing (in
// place) and connect resuming with the files intact.
// It skips entirely, saying why, when not root or when no OCI runtime works on this host.
import { test, before, after } from 'node:test'
import assert from 'node:assert/strict'
import { randomBytes } from 'node:crypto'

import { Sandbox, SandboxError, NotFoundError } from 'e2b'

import { startNode, stopNode } from './lib.mjs'

const apiKey = 'e2b_' + randomBytes(20).toString('hex')
const runId = randomBytes(4).toString('hex')

let skipReason = ''
let node // from startNode
let caps // GET /aenv/capabilities

async function api(method, p, body) {
  const res = await fetch(node.url + p, {
    method,
    headers: { 'X-API-Key': apiKey, ...(body ? { 'content-type': 'application/json' } : {}) },
    body: body ? JSON.stringify(body) : undefined,
  })
  const text = await res.text()
  return { status: res.status, body: text ? JSON.parse(text) : null }
}

before(async () => {
  // AENV_E2E_BIN runs another build of aenv (for example one made with `go build -overlay`).
  node = await startNode({ apiKey, bin: process.env.AENV_E2E_BIN || undefined, tag: 'aenv-e2e-snap-' })
  skipReason = node.skip
  if (skipReason) return
  process.env.E2B_API_URL = node.url
  process.env.E2B_SANDBOX_URL = node.url
  process.env.E2B_API_KEY = apiKey
  const res = await api('GET', '/aenv/capabilities')
  assert.equal(res.status, 200, `GET /aenv/capabilities: ${JSON.stringify(res.body)}`)
  caps = res.body
})

after(async () => {
  await stopNode(node)
})

const statePath = '/home/user/state.txt'

test('snapshot, create from it, fork, pause to disk, delete', { timeout: 300_000 }, async (t) => {
  if (skipReason) return t.skip(skipReason)
  if (!caps.snapshots) return t.skip(`OCI backend snapshot not yet available (backend ${caps.backend} reports snapshots: false)`)
  const name = 'e2e-' + runId
  const sbx = await Sandbox.create({ timeoutMs: 120_000 })
  const started = [sbx]
  try {
    await sbx.files.write(statePath, 'v1')

    // createSnapshot: the source keeps running with the same id. A backend may support
    // snapshots only for some root filesystems (the OCI backend: layered templates, not the
    // directory base template); it then answers 501 and the rest is skipped, saying why.
    let snap
    try {
      snap = await sbx.createSnapshot({ name })
    } catch (err) {
      if (err instanceof SandboxError && /^501:/.test(err.message)) {
        return t.skip('OCI backend snapshot not yet available for this template: ' + err.message)
      }
      throw err
    }
    assert.ok(snap.snapshotId)
    assert.deepEqual(snap.names, [name])
    assert.equal((await sbx.getInfo()).state, 'running')
    assert.equal((await sbx.commands.run('cat ' + statePath)).stdout, 'v1')
    await sbx.files.write(statePath, 'v2') // later writes of the source stay its own

    // listSnapshots: by source sandbox and by name.
    const mine = await sbx.listSnapshots().nextItems()
    assert.deepEqual(mine.map((s) => s.snapshotId), [snap.snapshotId])
    const byName = await Sandbox.listSnapshots({ name }).nextItems()
    assert.deepEqual(byName.map((s) => s.snapshotId), [snap.snapshotId])

    // Sandbox.create(snapshot id | name) sees the snapshot's files, not the source's later ones.
    for (const ref of [snap.snapshotId, name]) {
      const child = await Sandbox.create(ref, { timeoutMs: 60_000 })
      started.push(child)
      assert.notEqual(child.sandboxId, sbx.sandboxId)
      assert.equal(await child.files.read(statePath), 'v1', `child of ${ref}`)
    }

    // fork: children copy the source as it is now, and never see each other's writes.
    const forks = await sbx.fork({ count: 3, timeoutMs: 60_000 })
    assert.equal(forks.length, 3)
    for (const [i, f] of forks.entries()) {
      assert.ok(f instanceof Sandbox, `fork ${i}: ${f}`)
      started.push(f)
      assert.equal(await f.files.read(statePath), 'v2')
      await f.files.write('/home/user/mine.txt', String(i))
    }
    for (const [i, f] of forks.entries()) {
      assert.equal(await f.files.read('/home/user/mine.txt'), String(i))
    }
    await assert.rejects(sbx.files.read('/home/user/mine.txt'))
    assert.equal((await sbx.getInfo()).state, 'running')

    // Bad requests answer a 4xx and change nothing: a count of 0 or 1000, a name taken.
    for (const count of [0, 1000]) {
      await assert.rejects(sbx.fork({ count }), (err) => /\b400\b|count/i.test(err.message), `fork count ${count}`)
    }
    await assert.rejects(sbx.createSnapshot({ name }), (err) => err instanceof SandboxError && /409/.test(err.message))
    assert.deepEqual((await sbx.listSnapshots().nextItems()).map((s) => s.snapshotId), [snap.snapshotId])

    // pause with keepMemory:false, then connect: same id and token, the files are back.
    await Sandbox.pause(sbx.sandboxId, { keepMemory: false })
    assert.equal((await sbx.getInfo()).state, 'paused')
    // A paused sandbox cannot be snapshotted or forked (409) and stays paused.
    await assert.rejects(sbx.createSnapshot(), (err) => err instanceof SandboxError && /409/.test(err.message))
    await assert.rejects(sbx.fork({ count: 2 }), (err) => err instanceof SandboxError && /409/.test(err.message))
    assert.equal((await sbx.getInfo()).state, 'paused')
    const again = await Sandbox.connect(sbx.sandboxId)
    assert.equal(again.sandboxId, sbx.sandboxId)
    assert.equal(await again.files.read(statePath), 'v2')
    assert.equal((await again.commands.run('echo back')).stdout, 'back\n')

    // deleteSnapshot: true, then false; sandboxes made from it keep running.
    assert.equal(await Sandbox.deleteSnapshot(snap.snapshotId), true)
    assert.equal(await Sandbox.deleteSnapshot(snap.snapshotId), false)
    await assert.rejects(Sandbox.create(snap.snapshotId), (err) => err instanceof SandboxError && /404/.test(err.message))
    assert.equal(await started[1].isRunning(), true)

    await assert.rejects(Sandbox.fork('no-such-sandbox-' + runId), (err) => err instanceof NotFoundError)
  } finally {
    for (const s of started) await Sandbox.kill(s.sandboxId).catch(() => {})
  }
})

test('where snapshots are unavailable the node says so: 501 for snapshot and fork, pause keepMemory:false still works', { timeout: 120_000 }, async (t) => {
  if (skipReason) return t.skip(skipReason)
  const sbx = await Sandbox.create({ timeoutMs: 60_000 })
  try {
    await sbx.files.write(statePath, 'kept')
    let snap = null
    try {
      snap = await sbx.createSnapshot()
    } catch (err) {
      assert.ok(err instanceof SandboxError && /^501:/.test(err.message), `createSnapshot: ${err}`)
    }
    if (snap) {
      await Sandbox.deleteSnapshot(snap.snapshotId)
      return t.skip(`backend ${caps.backend} snapshots this template; the full flow covers it`)
    }
    await assert.rejects(sbx.fork({ count: 2 }), (err) => err instanceof SandboxError && /^501:/.test(err.message))
    assert.deepEqual(await sbx.listSnapshots().nextItems(), [])
    assert.equal((await sbx.getInfo()).state, 'running')
    // keepMemory:false pauses in place (keeping more than asked); connect brings it back.
    await Sandbox.pause(sbx.sandboxId, { keepMemory: false })
    assert.equal((await sbx.getInfo()).state, 'paused')
    const again = await Sandbox.connect(sbx.sandboxId)
    assert.equal(again.sandboxId, sbx.sandboxId)
    assert.equal(await again.files.read(statePath), 'kept')
    assert.equal((await again.commands.run('echo up')).stdout, 'up\n')
  } finally {
    await Sandbox.kill(sbx.sandboxId).catch(() => {})
  }
})
