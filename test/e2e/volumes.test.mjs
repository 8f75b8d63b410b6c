// SDK end-to-end test of volumes: the pinned e2b JS SDK (2.51.0) against a real `aenv serve`.
// A volume made with Volume.create is mounted by two sandboxes at once (volumeMounts at
// create): what one writes the other reads, concurrent appends all land, owners agree; the
// volume content API (Volume#readFile/writeFile/list) sees the same files; a paused and
// resumed sandbox keeps its mount; bad input (a name clash, an unknown volume, deleting a
// mounted volume) is refused; after a restart of the node on the same data dir the volume
// and its content are still there. The node gives volumes a 64 MB quota (volumes.size_mb:
// each is a loop-mounted ext4 image), which sandboxes and the content API both hit. Skips, saying why, when not root or without an OCI runtime.
import { test, before, after } from 'node:test'
import assert from 'node:assert/strict'
import { randomBytes } from 'node:crypto'

import { Sandbox, Volume } from 'e2b'

import { startNode, stopNode } from './lib.mjs'

const apiKey = 'e2b_' + randomBytes(20).toString('hex')
const runId = randomBytes(4).toString('hex')

let node
let skipReason = ''
const nodeEnv = { AENV_VOLUMES_SIZE_MB: '64' }
const sandboxes = []

function useNode(n) {
  process.env.E2B_API_URL = n.url
  process.env.E2B_SANDBOX_URL = n.url
  process.env.E2B_VOLUME_API_URL = n.url
  process.env.E2B_API_KEY = apiKey
}

before(async () => {
  node = await startNode({ apiKey, bin: process.env.AENV_E2E_BIN || undefined, tag: 'aenv-e2e-vol-', env: nodeEnv })
  skipReason = node.skip
  if (!skipReason) useNode(node)
})

after(async () => {
  for (const s of sandboxes) await s.kill().catch(() => {})
  await stopNode(node)
})

async function create(mounts) {
  const s = await Sandbox.create('base', { volumeMounts: mounts, timeoutMs: 120_000 })
  sandboxes.push(s)
  return s
}

const out = async (s, cmd) => (await s.commands.run(cmd)).stdout

test('volumes: shared between sandboxes, content API, pause, bad input, node restart', { timeout: 600_000 }, async (t) => {
  if (skipReason) return t.skip(skipReason)
  const name = 'e2e-vol-' + runId
  const vol = await Volume.create(name)
  assert.equal(vol.name, name)
  assert.ok((await Volume.list()).some((v) => v.volumeId === vol.volumeId))
  await assert.rejects(Volume.create(name), /exists/, 'a second volume with the same name')

  const a = await create({ '/mnt/shared': vol })
  const b = await create({ '/data': name })
  await a.commands.run('echo from-a > /mnt/shared/a.txt')
  assert.equal(await out(b, 'cat /data/a.txt'), 'from-a\n')
  // Both sandboxes' "user" is uid 1000 on the shared filesystem, whatever their uid ranges.
  assert.equal((await out(b, 'stat -c %u:%g /data/a.txt')).trim(), '1000:1000')
  await b.commands.run('echo from-b >> /data/a.txt')
  assert.equal(await out(a, 'cat /mnt/shared/a.txt'), 'from-a\nfrom-b\n')

  // Concurrent writers: appends from both sandboxes all land (O_APPEND on one filesystem).
  await Promise.all([
    a.commands.run('for i in $(seq 1 200); do echo a$i >> /mnt/shared/log; done'),
    b.commands.run('for i in $(seq 1 200); do echo b$i >> /data/log; done'),
  ])
  assert.equal((await out(a, 'wc -l < /mnt/shared/log')).trim(), '400')
  assert.equal((await out(b, 'grep -c ^a /data/log')).trim(), '200')

  // The content API sees and changes the same files.
  assert.equal(await vol.readFile('/a.txt'), 'from-a\nfrom-b\n')
  const st = await vol.writeFile('/api/from-api.txt', 'written by the API')
  assert.equal(st.type, 'file')
  assert.equal(st.size, 18)
  assert.equal(await out(a, 'cat /mnt/shared/api/from-api.txt'), 'written by the API')
  const names = (await vol.list('/')).map((e) => e.name).sort()
  assert.deepEqual(names, ['a.txt', 'api', 'log'])
  assert.equal(await vol.exists('/nope'), false)

  const info = await Sandbox.getInfo(b.sandboxId)
  assert.deepEqual(info.volumeMounts, [{ name, path: '/data' }])

  // Bad input: nothing changes.
  await assert.rejects(create({ '/x': 'no-such-volume-' + runId }), /not found/)
  await assert.rejects(create({ '/proc/x': name }), /\/proc/)
  await assert.rejects(Volume.destroy(vol.volumeId), /mounted/)
  for (const bad of ['', 'a/b', '-x', 'x'.repeat(64), 'sp ace']) {
    await assert.rejects(Volume.create(bad), /400|must be|name/, `volume name ${JSON.stringify(bad)}`)
  }

  // The size quota: a writer in a sandbox and the content API stop at 64 MB.
  assert.match(await out(a, 'dd if=/dev/zero of=/mnt/shared/fill bs=1M count=80 2>&1; rm -f /mnt/shared/fill; true'), /No space left/)
  await assert.rejects(vol.writeFile('/fill', 'x'.repeat(80 << 20)), /quota|space|507/i)
  assert.equal(await vol.exists('/fill'), false, 'a refused upload leaves nothing')
  assert.equal(await out(b, 'cat /data/a.txt'), 'from-a\nfrom-b\n', 'the volume still works once full was hit')

  // Pause and resume keep the mount.
  await b.pause()
  await a.commands.run('echo while-paused > /mnt/shared/p.txt')
  const b2 = await Sandbox.connect(b.sandboxId)
  assert.equal(await out(b2, 'cat /data/p.txt'), 'while-paused\n')

  for (const s of sandboxes.splice(0)) await s.kill()

  // A restart of the node on the same data dir keeps the volume, its content and token.
  await stopNode(node, { keepDataDir: true })
  node = await startNode({ apiKey, bin: process.env.AENV_E2E_BIN || undefined, dataDir: node.dataDir, env: nodeEnv })
  assert.equal(node.skip, '')
  useNode(node)
  const again = await Volume.connect(vol.volumeId)
  assert.equal(again.name, name)
  assert.equal(await again.readFile('/a.txt'), 'from-a\nfrom-b\n')
  const c = await create({ '/v': name })
  assert.equal((await out(c, 'wc -l < /v/log')).trim(), '400')
  await c.kill()
  sandboxes.splice(0)
  assert.equal(await Volume.destroy(vol.volumeId), true)
  assert.equal(await Volume.destroy(vol.volumeId), false)
  assert.ok(!(await Volume.list()).some((v) => v.volumeId === vol.volumeId))
})

test('volumes: a snapshot records its mounts, fork children and a pause to disk keep them', { timeout: 300_000 }, async (t) => {
  if (skipReason) return t.skip(skipReason)
  const name = 'e2e-snapvol-' + runId
  const vol = await Volume.create(name)
  const src = await create({ '/mnt/v': name })
  try {
    await src.commands.run('echo before > /mnt/v/f')
    let snap
    try {
      snap = await src.createSnapshot()
    } catch (err) {
      if (/^501:/.test(err.message)) return t.skip('snapshots unavailable for this template: ' + err.message)
      throw err
    }
    // The snapshot holds which volume is mounted where, not the volume's content.
    await src.commands.run('echo after > /mnt/v/f')
    const child = await Sandbox.create(snap.snapshotId, { timeoutMs: 60_000 })
    sandboxes.push(child)
    assert.equal(await out(child, 'cat /mnt/v/f'), 'after\n')
    assert.deepEqual((await Sandbox.getInfo(child.sandboxId)).volumeMounts, [{ name, path: '/mnt/v' }])

    const [fork] = await src.fork({ count: 1, timeoutMs: 60_000 })
    assert.ok(fork instanceof Sandbox, String(fork))
    sandboxes.push(fork)
    await fork.commands.run('echo from-fork > /mnt/v/g')
    assert.equal(await out(src, 'cat /mnt/v/g'), 'from-fork\n')

    await child.pause({ keepMemory: false })
    const resumed = await Sandbox.connect(child.sandboxId)
    assert.equal(await out(resumed, 'cat /mnt/v/g'), 'from-fork\n')
  } finally {
    for (const s of sandboxes.splice(0)) await s.kill().catch(() => {})
  }
  assert.equal(await Volume.destroy(vol.volumeId), true)
})
