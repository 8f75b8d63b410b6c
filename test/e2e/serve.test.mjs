// SDK end-to-end test: the pinned e2b JS SDK (2.51.0) against a real `aenv serve` in
// single-server mode (E2B_API_URL = E2B_SANDBOX_URL = the node), with real OCI sandboxes.
//
// It starts ../../bin/aenv serve itself on a free loopback port with a temporary data dir and
// an explicit AENV_API_KEY, and skips (saying why) only when not root or when no OCI runtime
// works on this host.
import { test, before, after } from 'node:test'
import assert from 'node:assert/strict'
import { spawn } from 'node:child_process'
import { randomBytes } from 'node:crypto'
import fs from 'node:fs'
import net from 'node:net'
import os from 'node:os'
import path from 'node:path'
import { setTimeout as sleep } from 'node:timers/promises'
import { fileURLToPath } from 'node:url'

import { Sandbox, AuthenticationError, NotFoundError, SandboxError } from 'e2b'

const root = path.resolve(path.dirname(fileURLToPath(import.meta.url)), '../..')
const aenvBin = path.join(root, 'bin', 'aenv')
const envdBin = path.join(root, 'bin', 'envd')
const baseRootfs = path.join(root, 'bin', 'base-rootfs')
const apiKey = 'e2b_' + randomBytes(20).toString('hex')
const runId = randomBytes(4).toString('hex')

let skipReason = ''
let node // { proc, url, dataDir, log }

function freePort() {
  return new Promise((resolve, reject) => {
    const srv = net.createServer()
    srv.unref()
    srv.on('error', reject)
    srv.listen(0, '127.0.0.1', () => {
      const { port } = srv.address()
      srv.close(() => resolve(port))
    })
  })
}

// startNode runs `aenv serve` and waits for GET /health = 204. It resolves to null with
// skipReason set when the host cannot run sandboxes.
async function startNode() {
  if (process.getuid?.() !== 0) {
    skipReason = 'needs root (aenv serve runs OCI containers, network namespaces and overlay mounts)'
    return null
  }
  for (const bin of [aenvBin, envdBin]) {
    if (!fs.existsSync(bin)) throw new Error(`${bin} is missing: run \`make build\` first`)
  }
  const port = await freePort()
  const url = `http://127.0.0.1:${port}`
  const dataDir = fs.mkdtempSync(path.join(os.tmpdir(), 'aenv-e2e-'))
  const args = ['serve', '--listen', `127.0.0.1:${port}`, '--data-dir', dataDir, '--envd', envdBin]
  if (fs.existsSync(baseRootfs)) args.push('--base-rootfs', baseRootfs)
  let log = ''
  const proc = spawn(aenvBin, args, {
    env: { ...process.env, AENV_API_KEY: apiKey, AENV_LOG_LEVEL: 'info' },
    stdio: ['ignore', 'pipe', 'pipe'],
  })
  proc.stdout.on('data', (d) => { log += d })
  proc.stderr.on('data', (d) => { log += d })
  let exited = null
  proc.on('exit', (code, signal) => { exited = { code, signal } })

  const deadline = Date.now() + 120_000
  while (Date.now() < deadline) {
    if (exited) {
      if (/no OCI runtime/i.test(log)) {
        skipReason = 'no OCI runtime works on this host: ' + log.trim().split('\n').pop()
        fs.rmSync(dataDir, { recursive: true, force: true })
        return null
      }
      throw new Error(`aenv serve exited (${JSON.stringify(exited)}):\n${log}`)
    }
    try {
      const res = await fetch(url + '/health')
      if (res.status === 204) return { proc, url, dataDir, log: () => log }
    } catch {
      // not listening yet
    }
    await sleep(200)
  }
  proc.kill('SIGKILL')
  throw new Error(`aenv serve did not become healthy within 120 s:\n${log}`)
}

before(async () => {
  node = await startNode()
  if (node) {
    // Single-server mode, exactly as a user configures the SDK.
    process.env.E2B_API_URL = node.url
    process.env.E2B_SANDBOX_URL = node.url
    process.env.E2B_API_KEY = apiKey
  }
})

after(async () => {
  if (!node) return
  node.proc.kill('SIGTERM')
  const exited = await Promise.race([
    new Promise((resolve) => node.proc.once('exit', () => resolve(true))),
    // unref'd, so a pending timer does not hold the test process open after the node exits
    sleep(60_000, false, { ref: false }),
  ])
  if (!exited) {
    node.proc.kill('SIGKILL')
    console.error('aenv serve did not stop within 60 s of SIGTERM:\n' + node.log())
  }
  fs.rmSync(node.dataDir, { recursive: true, force: true })
})

function skipIfUnavailable(t) {
  if (skipReason) {
    t.skip(skipReason)
    return true
  }
  return false
}

test('SDK flow: create, commands, files, list, timeout, info, pause, connect, kill', { timeout: 300_000 }, async (t) => {
  if (skipIfUnavailable(t)) return
  const metadata = { suite: runId, user: 'a b' }
  const sbx = await Sandbox.create({ metadata, timeoutMs: 120_000 })
  const extra = []
  try {
    assert.match(sbx.sandboxId, /^[a-z0-9]+$/)

    // commands.run goes through the node's proxy to envd (Connect server stream).
    const hi = await sbx.commands.run('echo hi')
    assert.equal(hi.stdout, 'hi\n')
    assert.equal(hi.exitCode, 0)
    const who = await sbx.commands.run('whoami && echo $HOME')
    assert.equal(who.stdout, 'user\n/home/user\n')

    // files: write, read, list, and a signed download URL (no sandbox header at all).
    await sbx.files.write('/home/user/hello.txt', 'hello world')
    assert.equal(await sbx.files.read('/home/user/hello.txt'), 'hello world')
    const entries = await sbx.files.list('/home/user')
    assert.ok(entries.some((e) => e.name === 'hello.txt'), 'files.list shows the written file')
    const signedUrl = await sbx.downloadUrl('/home/user/hello.txt')
    assert.match(signedUrl, /signature=v1_/)
    const dl = await fetch(signedUrl)
    assert.equal(dl.status, 200)
    assert.equal(await dl.text(), 'hello world')

    // list: metadata filter (JS encoding) and paging with X-Next-Token.
    for (let i = 0; i < 2; i++) extra.push(await Sandbox.create({ metadata: { suite: runId }, timeoutMs: 120_000 }))
    const filtered = await Sandbox.list({ query: { metadata } }).nextItems()
    assert.deepEqual(filtered.map((s) => s.sandboxId), [sbx.sandboxId])
    assert.equal(filtered[0].metadata.user, 'a b')
    const pager = Sandbox.list({ query: { metadata: { suite: runId } }, limit: 2 })
    const page1 = await pager.nextItems()
    assert.equal(page1.length, 2)
    assert.equal(pager.hasNext, true, 'a full first page announces more')
    const page2 = await pager.nextItems()
    assert.equal(page2.length, 1)
    assert.equal(pager.hasNext, false)
    const ids = new Set([...page1, ...page2].map((s) => s.sandboxId))
    assert.equal(ids.size, 3)

    // setTimeout then getInfo: the expiry moved to about now + 60 s.
    await sbx.setTimeout(60_000)
    const info = await sbx.getInfo()
    assert.equal(info.sandboxId, sbx.sandboxId)
    assert.equal(info.state, 'running')
    assert.equal(info.templateId, 'base')
    const left = info.endAt.getTime() - Date.now()
    assert.ok(left > 40_000 && left <= 61_000, `endAt is ${left} ms away, want about 60 s`)

    // betaPause: true, then false (already paused); getInfo shows it paused.
    assert.equal(await sbx.betaPause(), true)
    assert.equal(await sbx.betaPause(), false)
    assert.equal((await sbx.getInfo()).state, 'paused')

    // connect resumes it with the same id and token; the filesystem survived.
    const again = await Sandbox.connect(sbx.sandboxId)
    assert.equal(again.sandboxId, sbx.sandboxId)
    assert.equal((await again.getInfo()).state, 'running')
    assert.equal(await again.files.read('/home/user/hello.txt'), 'hello world')
    const after = await again.commands.run('echo back')
    assert.equal(after.stdout, 'back\n')

    // kill: true, then getInfo 404, isRunning false, kill again false.
    assert.equal(await sbx.kill(), true)
    await assert.rejects(sbx.getInfo(), (err) => err instanceof NotFoundError)
    assert.equal(await sbx.isRunning(), false)
    assert.equal(await Sandbox.kill(sbx.sandboxId), false)
  } finally {
    for (const s of [sbx, ...extra]) await Sandbox.kill(s.sandboxId).catch(() => {})
  }
})

test('a bad API key is an AuthenticationError', async (t) => {
  if (skipIfUnavailable(t)) return
  const bad = { apiKey: 'e2b_' + '0'.repeat(40) }
  await assert.rejects(Sandbox.list(bad).nextItems(), (err) => err instanceof AuthenticationError)
  await assert.rejects(Sandbox.create(bad), (err) => err instanceof AuthenticationError)
})

test('an unknown template is a clear 4xx', async (t) => {
  if (skipIfUnavailable(t)) return
  await assert.rejects(Sandbox.create('no-such-template-' + runId), (err) => {
    assert.ok(err instanceof SandboxError, `got ${err?.constructor?.name}: ${err?.message}`)
    assert.match(err.message, /404/)
    assert.match(err.message, /template/i)
    return true
  })
})
