// SDK end-to-end test of outbound network rules and sandbox logs: the pinned e2b JS SDK
// (2.51.0) against a real `aenv serve`. A "remote" network namespace stands for a host
// outside the node (reached through the node's forwarding and NAT, like the internet), with a
// TCP listener on two addresses of one /24; the sandbox probes them with busybox nc.
// Skips, saying why, when not root or when no OCI runtime works on this host.
import { test, before, after } from 'node:test'
import assert from 'node:assert/strict'
import { randomBytes } from 'node:crypto'
import { spawn, execFileSync } from 'node:child_process'

import { Sandbox, SandboxError, CommandExitError, Template } from 'e2b'

import { startNode, stopNode, sleep } from './lib.mjs'

const apiKey = 'e2b_' + randomBytes(20).toString('hex')

let skipReason = ''
let node
let remote // {ns, veth, a, b, proc}

const ip = (...args) => execFileSync('ip', args, { stdio: ['ignore', 'pipe', 'pipe'] })

// setupRemote makes netns <ns> with 10.98.<n>.2 and .3 behind host veth <veth> (10.98.<n>.1)
// and a listener answering "hi" on port 8080 of both addresses.
async function setupRemote(n) {
  const ns = `aetr${n}`
  const veth = `aetr${n}h`
  const sub = `10.98.${n}`
  try { ip('link', 'del', veth) } catch {}
  try { ip('netns', 'del', ns) } catch {}
  ip('netns', 'add', ns)
  ip('link', 'add', veth, 'type', 'veth', 'peer', 'name', 'eth0', 'netns', ns)
  ip('addr', 'add', `${sub}.1/24`, 'dev', veth)
  ip('link', 'set', veth, 'up')
  ip('-n', ns, 'addr', 'add', `${sub}.2/24`, 'dev', 'eth0')
  ip('-n', ns, 'addr', 'add', `${sub}.3/24`, 'dev', 'eth0')
  ip('-n', ns, 'link', 'set', 'eth0', 'up')
  ip('-n', ns, 'link', 'set', 'lo', 'up')
  const script = "const n=require('net');for(const h of process.argv.slice(1))" +
    "n.createServer(s=>s.end('hi\\n')).listen(8080,h);console.log('ready')"
  const proc = spawn('ip', ['netns', 'exec', ns, process.execPath, '-e', script, `${sub}.2`, `${sub}.3`],
    { stdio: ['ignore', 'pipe', 'inherit'] })
  await new Promise((res, rej) => {
    proc.stdout.once('data', res)
    proc.once('exit', (c) => rej(new Error(`remote listener exited ${c}`)))
  })
  return { ns, veth, proc, a: `${sub}.2`, b: `${sub}.3`, sub }
}

function teardownRemote(r) {
  if (!r) return
  r.proc.kill('SIGKILL')
  try { ip('link', 'del', r.veth) } catch {}
  try { ip('netns', 'del', r.ns) } catch {}
}

before(async () => {
  // The remote stands in for a private network the operator opened (network.allow_ranges):
  // infrastructure ranges such as 10/8 are closed to sandboxes by default.
  node = await startNode({
    apiKey, bin: process.env.AENV_E2E_BIN || undefined, tag: 'aenv-e2e-net-',
    env: { AENV_NETWORK_ALLOW_RANGES: '10.98.0.0/16' },
  })
  skipReason = node.skip
  if (skipReason) return
  process.env.E2B_API_URL = node.url
  process.env.E2B_SANDBOX_URL = node.url
  process.env.E2B_API_KEY = apiKey
  remote = await setupRemote(Number(node.net.bridge.slice(3)))
})

after(async () => {
  teardownRemote(remote)
  await stopNode(node)
})

// reach says whether the sandbox gets the listener's answer from addr:8080. A success may
// take a retry (ARP on a fresh veth); a failure is one 2 s attempt.
async function reach(sbx, addr, want) {
  for (let i = 0; ; i++) {
    let ok = false
    try {
      const r = await sbx.commands.run(`timeout 3 nc -w 2 ${addr} 8080 </dev/null`, { timeoutMs: 10_000 })
      ok = r.stdout.trim() === 'hi'
    } catch (err) {
      if (!(err instanceof CommandExitError)) throw err
    }
    if (ok || !want || i >= 5) return ok
    await sleep(300)
  }
}

async function expectReach(sbx, wantA, wantB, what) {
  const [a, b] = [await reach(sbx, remote.a, wantA), await reach(sbx, remote.b, wantB)]
  assert.deepEqual([a, b], [wantA, wantB], `${what}: reach ${remote.a}, ${remote.b}`)
}

async function logs(id, query = '') {
  const res = await fetch(`${node.url}/v2/sandboxes/${id}/logs${query}`, { headers: { 'X-API-Key': apiKey } })
  assert.equal(res.status, 200)
  return (await res.json()).logs
}

test('denyOut/allowOut at create, updateNetwork live, rules survive pause, logs', { timeout: 300_000 }, async (t) => {
  if (skipReason) return t.skip(skipReason)
  // base-minimal: busybox's nc and httpd.
  const sbx = await Sandbox.create('base-minimal', {
    timeoutMs: 180_000,
    network: { denyOut: [`${remote.sub}.0/24`], allowOut: [remote.b] },
  })
  try {
    await expectReach(sbx, false, true, 'create: deny the /24 except .3')
    const info = await sbx.getInfo()
    assert.deepEqual(info.network.denyOut, [`${remote.sub}.0/24`])
    assert.deepEqual(info.network.allowOut, [`${remote.b}/32`])
    assert.equal(info.allowInternetAccess, true)

    // The update replaces everything: omitted lists are cleared.
    await sbx.updateNetwork({})
    await expectReach(sbx, true, true, 'update: no rules')
    await sbx.updateNetwork({ allowInternetAccess: false, allowOut: [remote.a] })
    await expectReach(sbx, true, false, 'update: no internet except .2')
    assert.equal((await sbx.getInfo()).allowInternetAccess, false)

    // Bad input: 400 with the reason, and the rules in force stay.
    await assert.rejects(sbx.updateNetwork({ denyOut: ['10.0.0.0/33'] }),
      (err) => err instanceof SandboxError && /400: .*network\.denyOut/.test(err.message))
    await assert.rejects(sbx.updateNetwork({ allowOut: ['api.*.example.com'], denyOut: ['0.0.0.0/0'] }),
      (err) => err instanceof SandboxError && /400: .*network\.allowOut.*domain pattern/.test(err.message))
    await assert.rejects(sbx.updateNetwork({ denyOut: ['api.example.com'] }),
      (err) => err instanceof SandboxError && /400: .*domain name/.test(err.message))
    await expectReach(sbx, true, false, 'after refused updates')

    // Pause (in place or to disk) and resume: same rules.
    assert.equal(await sbx.betaPause(), true)
    await sbx.connect({ timeoutMs: 120_000 })
    await expectReach(sbx, true, false, 'after pause and resume')

    const entries = await logs(sbx.sandboxId)
    const messages = entries.map((e) => e.message)
    for (const m of ['sandbox started', 'network rules updated', 'sandbox paused']) {
      assert.ok(messages.includes(m), `logs lack "${m}": ${JSON.stringify(messages)}`)
    }
    assert.ok(entries.every((e) => e.timestamp && e.level && e.fields), JSON.stringify(entries[0]))
    const newest = await logs(sbx.sandboxId, '?direction=backward&limit=1')
    assert.equal(newest.length, 1)
    assert.ok(Date.parse(newest[0].timestamp) >= Date.parse(entries[0].timestamp))
  } finally {
    await sbx.kill()
  }
  await assert.rejects(Sandbox.updateNetwork(sbx.sandboxId, {}), /not found/)
})

test('allowPublicTraffic: false needs the traffic access token on user ports', { timeout: 120_000 }, async (t) => {
  if (skipReason) return t.skip(skipReason)
  const sbx = await Sandbox.create('base-minimal', { timeoutMs: 60_000, network: { allowPublicTraffic: false } })
  try {
    assert.ok(sbx.trafficAccessToken, 'a private sandbox has a traffic access token')
    assert.equal((await sbx.getInfo()).network.allowPublicTraffic, false)
    await sbx.commands.run('mkdir -p /tmp/www && echo private > /tmp/www/index.html && httpd -p 8080 -h /tmp/www')
    const url = `${node.url}/proxy/${sbx.sandboxId}/8080/`
    let res
    for (let i = 0; i < 20; i++) {
      res = await fetch(url, { headers: { 'e2b-traffic-access-token': sbx.trafficAccessToken } })
      if (res.status === 200) break
      await sleep(200)
    }
    assert.equal(res.status, 200)
    assert.equal((await res.text()).trim(), 'private')
    assert.equal((await fetch(url)).status, 403)
    assert.equal((await fetch(url, { headers: { 'e2b-traffic-access-token': 'wrong' } })).status, 403)
  } finally {
    await sbx.kill()
  }
})

test('sandbox logs carry the template start command output', { timeout: 300_000 }, async (t) => {
  if (skipReason) return t.skip(skipReason)
  const name = `e2e-logs-${randomBytes(4).toString('hex')}`
  await Template.build(
    Template().fromTemplate('base-minimal').setStartCmd('echo hello-from-start; echo to-stderr >&2; sleep 600', 'true'), name)
  const sbx = await Sandbox.create(name, { timeoutMs: 60_000 })
  try {
    let entries = []
    for (let i = 0; i < 50; i++) {
      entries = await logs(sbx.sandboxId)
      if (entries.some((e) => e.message === 'to-stderr')) break
      await sleep(200)
    }
    const out = entries.find((e) => e.message === 'hello-from-start')
    const err = entries.find((e) => e.message === 'to-stderr')
    assert.ok(out && err, JSON.stringify(entries))
    assert.equal(out.level, 'info')
    assert.equal(out.fields.stream, 'stdout')
    assert.equal(err.level, 'warn')
    assert.equal(err.fields.stream, 'stderr')
    assert.deepEqual((await logs(sbx.sandboxId, '?level=warn&search=stderr')).map((e) => e.message), ['to-stderr'])

    const res = await fetch(`${node.url}/sandboxes/${sbx.sandboxId}/logs`, { headers: { 'X-API-Key': apiKey } })
    assert.equal(res.status, 200)
    const v1 = await res.json()
    assert.ok(v1.logs.some((l) => l.line === 'hello-from-start' && l.timestamp), JSON.stringify(v1.logs))
    assert.equal(v1.logs.length, v1.logEntries.length)
  } finally {
    await sbx.kill()
  }
  const gone = await fetch(`${node.url}/v2/sandboxes/${sbx.sandboxId}/logs`, { headers: { 'X-API-Key': apiKey } })
  assert.equal(gone.status, 404)
})
