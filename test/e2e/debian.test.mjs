// SDK end-to-end test of an image as images are published: a debootstrap minbase Debian
// root (usr-merged, glibc, no `user` account; scripts/debian-root.sh builds it once per
// machine) served by the loopback registry helper, pulled with `aenv pull` (converted into
// layers: the default where the node's base template is layered), then driven with the
// pinned e2b JS SDK: commands as `user` and root, files, snapshot and fork.
// It skips, saying why, when not root, without an OCI runtime, or without debootstrap.
import { test, before, after } from 'node:test'
import assert from 'node:assert/strict'
import { execFileSync, spawn } from 'node:child_process'
import { randomBytes } from 'node:crypto'
import fs from 'node:fs'
import os from 'node:os'
import path from 'node:path'
import { fileURLToPath } from 'node:url'

import { Sandbox, SandboxError } from 'e2b'

import { startNode, stopNode } from './lib.mjs'

const root = path.resolve(path.dirname(fileURLToPath(import.meta.url)), '../..')
const apiKey = 'e2b_' + randomBytes(20).toString('hex')
const runId = randomBytes(4).toString('hex')

let skipReason = ''
let node
let registry // { proc, host, dir }

function debianRoot() {
  try {
    execFileSync('which', ['debootstrap'], { stdio: 'ignore' })
  } catch {
    return { skip: 'needs debootstrap (scripts/deps.sh installs it)' }
  }
  return { dir: execFileSync(path.join(root, 'scripts/debian-root.sh'), { encoding: 'utf8' }).trim() }
}

async function startRegistry(debian) {
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'aenv-e2e-debreg-'))
  const bin = path.join(dir, 'registry')
  execFileSync('go', ['build', '-o', bin, './test/e2e/registry'], { cwd: root, stdio: 'inherit' })
  const proc = spawn(bin, ['--debian-root', debian], { stdio: ['ignore', 'pipe', 'inherit'] })
  let out = ''
  const host = await new Promise((resolve, reject) => {
    proc.on('exit', (code) => reject(new Error(`registry helper exited with ${code}: ${out}`)))
    proc.stdout.on('data', (d) => {
      out += d
      const m = out.match(/^READY (\S+) (\S+)$/m)
      if (m) resolve(m[1])
    })
  })
  proc.removeAllListeners('exit')
  return { proc, host, dir }
}

before(async () => {
  node = await startNode({ apiKey, tag: 'aenv-e2e-deb-', logFile: process.env.AENV_E2E_LOG || '' })
  skipReason = node.skip
  if (skipReason) return
  const deb = debianRoot()
  if (deb.skip) {
    skipReason = deb.skip
    return
  }
  registry = await startRegistry(deb.dir)
  process.env.E2B_API_URL = node.url
  process.env.E2B_SANDBOX_URL = node.url
  process.env.E2B_API_KEY = apiKey
})

after(async () => {
  if (registry) {
    registry.proc.kill('SIGKILL')
    fs.rmSync(registry.dir, { recursive: true, force: true })
  }
  await stopNode(node)
})

test('a Debian image pulled as published: user and root, files, snapshot, fork', { timeout: 600_000 }, async (t) => {
  if (skipReason) return t.skip(skipReason)
  const name = `debian-${runId}`
  execFileSync(node.bin, ['--url', node.url, '--api-key', apiKey, 'pull', `${registry.host}/debian:bookworm`, '--name', name],
    { encoding: 'utf8', stdio: ['ignore', 'pipe', 'pipe'] })

  const sbx = await Sandbox.create(name, { timeoutMs: 300_000 })
  const started = [sbx]
  try {
    // The SDK's default user exists: uid 1000, home /home/user owned by it, bash.
    let r = await sbx.commands.run('id -un; id -u; echo $HOME; pwd; stat -c %U ~; echo $SHELL; cat /etc/debian_version')
    const [who, uid, home, cwd, owner, shell] = r.stdout.split('\n')
    assert.deepEqual([who, uid, home, cwd, owner, shell], ['user', '1000', '/home/user', '/home/user', 'user', '/bin/bash'])
    r = await sbx.commands.run('id -u; apt-get --version | head -1; touch /root/made && echo ok', { user: 'root' })
    assert.match(r.stdout, /^0\napt \S+ .*\nok\n$/)
    await assert.rejects(sbx.commands.run('touch /root/nope'), (err) => /Permission denied/.test(err.stderr ?? err.message))

    await sbx.files.write('/home/user/state.txt', 'v1')
    await sbx.files.write('/root/secret.txt', 'root only', { user: 'root' })
    assert.equal(await sbx.files.read('/home/user/state.txt'), 'v1')
    assert.equal(await sbx.files.read('/root/secret.txt', { user: 'root' }), 'root only')
    assert.equal((await sbx.commands.run('stat -c %U /root/secret.txt', { user: 'root' })).stdout, 'root\n')
    assert.equal((await sbx.commands.run('stat -c %U /home/user/state.txt')).stdout, 'user\n')

    // A converted (layered) template's sandboxes snapshot and fork.
    let snap
    try {
      snap = await sbx.createSnapshot({ name: `${name}-snap` })
    } catch (err) {
      if (err instanceof SandboxError && /^501:/.test(err.message)) {
        return t.skip('the image was not converted into layers on this node: ' + err.message)
      }
      throw err
    }
    await sbx.files.write('/home/user/state.txt', 'v2')
    const child = await Sandbox.create(snap.snapshotId, { timeoutMs: 60_000 })
    started.push(child)
    assert.equal(await child.files.read('/home/user/state.txt'), 'v1')
    assert.equal((await child.commands.run('id -un')).stdout, 'user\n')

    const forks = await sbx.fork({ count: 2, timeoutMs: 60_000 })
    for (const [i, f] of forks.entries()) {
      assert.ok(f instanceof Sandbox, `fork ${i}: ${f}`)
      started.push(f)
      assert.equal(await f.files.read('/home/user/state.txt'), 'v2')
      assert.equal((await f.commands.run('id -u', { user: 'root' })).stdout, '0\n')
      await f.files.write('/home/user/mine.txt', String(i))
    }
    assert.equal(await forks[0].files.read('/home/user/mine.txt'), '0')
    assert.equal(await forks[1].files.read('/home/user/mine.txt'), '1')
    assert.equal(await Sandbox.deleteSnapshot(snap.snapshotId), true)
  } finally {
    for (const s of started) await Sandbox.kill(s.sandboxId).catch(() => {})
  }
})
