// SDK end-to-end test: the pinned e2b JS SDK (2.51.0) against a real `aenv serve` in
// single-server mode (E2B_API_URL = E2B_SANDBOX_URL = the node), with real OCI sandboxes.
//
// It starts ../../bin/aenv serve itself (lib.mjs startNode: a free loopback port, a temporary
// data dir, an explicit AENV_API_KEY, a sandbox network and cgroup parent of its own), and skips
// (saying why) only when not root or when no OCI runtime works on this host.
import { test, before, after } from 'node:test'
import assert from 'node:assert/strict'
import { randomBytes } from 'node:crypto'

import { Sandbox, AuthenticationError, NotFoundError, SandboxError } from 'e2b'

import { startNode, stopNode } from './lib.mjs'

const apiKey = 'e2b_' + randomBytes(20).toString('hex')
const runId = randomBytes(4).toString('hex')

let skipReason = ''
let node // from startNode

before(async () => {
  node = await startNode({ apiKey, tag: 'aenv-e2e-' })
  skipReason = node.skip
  if (!skipReason) {
    // Single-server mode, exactly as a user configures the SDK.
    process.env.E2B_API_URL = node.url
    process.env.E2B_SANDBOX_URL = node.url
    process.env.E2B_API_KEY = apiKey
  }
})

after(async () => {
  await stopNode(node)
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

// AgentENV users point the SDK at $URL/proxy: every envd request then carries the /proxy prefix
// and E2B's routing headers. AgentENV's own header names are aliases. A paused sandbox without
// autoResume answers E2B's 409 through the proxy.
test('AgentENV-style E2B_SANDBOX_URL=$URL/proxy, x-agentenv headers, paused 409', { timeout: 300_000 }, async (t) => {
  if (skipIfUnavailable(t)) return
  const sbx = await Sandbox.create({ timeoutMs: 120_000, sandboxUrl: `${node.url}/proxy`, envs: { MARK: 'agentenv' } })
  try {
    const r = await sbx.commands.run('echo $MARK')
    assert.equal(r.stdout, 'agentenv\n')
    await sbx.files.write('/home/user/a.txt', 'via /proxy')
    assert.equal(await sbx.files.read('/home/user/a.txt'), 'via /proxy')
    assert.equal(await sbx.isRunning(), true)

    // AgentENV's header names reach envd (GET /envs needs the token, so the node's own
    // routes cannot be what answers).
    const res = await fetch(`${node.url}/envs`, {
      headers: {
        'x-agentenv-sandbox-id': sbx.sandboxId, 'x-agentenv-target-port': '49983',
        'x-access-token': sbx.envdAccessToken ?? '',
      },
    })
    assert.equal(res.status, 200, await res.clone().text())
    assert.equal((await res.json()).MARK, 'agentenv')

    assert.equal(await sbx.betaPause(), true)
    const paused = await fetch(`${node.url}/proxy/health`, {
      headers: { 'e2b-sandbox-id': sbx.sandboxId, 'e2b-sandbox-port': '49983' },
    })
    assert.equal(paused.status, 409)
    assert.deepEqual(await paused.json(),
      { sandboxId: sbx.sandboxId, message: 'The sandbox is paused', code: 409, canAutoResume: false })
    // Connect reports the status only ("[unknown] HTTP 409"), never a hang or a 502.
    await assert.rejects(sbx.commands.run('true'), (err) => {
      assert.match(String(err?.message), /409/)
      return true
    })
  } finally {
    await Sandbox.kill(sbx.sandboxId).catch(() => {})
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
