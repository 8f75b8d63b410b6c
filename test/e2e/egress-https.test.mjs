// SDK end-to-end test of network.rules over HTTPS: the node's egress proxy terminates TLS
// to domains that have rules, with certificates of the node's egress CA, which sandboxes
// with rules trust (the Debian `base`: curl, python3, node), and verifies the real server
// against its roots (here a test CA given by network.egress_upstream_ca). A network
// namespace made here stands for the internet (egress-remote.cjs with a certificate): an
// HTTPS server for api.tls.test and plain.tls.test and the sandboxes' DNS server. Skips,
// saying why, when not root or when no OCI runtime works on this host.
import { test, before, after } from 'node:test'
import assert from 'node:assert/strict'
import { randomBytes } from 'node:crypto'
import { spawn, execFileSync } from 'node:child_process'
import { fileURLToPath } from 'node:url'
import { mkdtempSync, writeFileSync, readFileSync, rmSync } from 'node:fs'
import { tmpdir } from 'node:os'
import { join } from 'node:path'

import { Sandbox, Secret } from 'e2b'

import { startNode, stopNode } from './lib.mjs'

const apiKey = 'e2b_' + randomBytes(20).toString('hex')
const WEB = '192.88.97.80'
const DNS = '192.88.97.53'

let skipReason = ''
let node
let remote // {ns, veth, proc}
let certDir

const ip = (...args) => execFileSync('ip', args, { stdio: ['ignore', 'pipe', 'pipe'] })
const openssl = (...args) => execFileSync('openssl', args, { cwd: certDir, stdio: ['ignore', 'pipe', 'pipe'] })

// makeCerts writes a test CA (up-ca.pem: the "public roots" of this test's internet) and
// the server's certificate for api.tls.test and plain.tls.test.
function makeCerts() {
  certDir = mkdtempSync(join(tmpdir(), 'aenv-e2e-tls-'))
  const ec = ['-newkey', 'ec', '-pkeyopt', 'ec_paramgen_curve:prime256v1', '-nodes']
  openssl('req', '-x509', ...ec, '-keyout', 'up-ca.key', '-out', 'up-ca.pem', '-days', '2', '-subj', '/CN=aenv e2e upstream CA')
  openssl('req', ...ec, '-keyout', 'srv.key', '-out', 'srv.csr', '-subj', '/CN=api.tls.test')
  writeFileSync(join(certDir, 'san.ext'), 'subjectAltName=DNS:api.tls.test,DNS:plain.tls.test\n')
  openssl('x509', '-req', '-in', 'srv.csr', '-CA', 'up-ca.pem', '-CAkey', 'up-ca.key', '-CAcreateserial',
    '-out', 'srv.pem', '-days', '2', '-extfile', 'san.ext')
}

async function setupRemote(n) {
  const ns = `aeth${n}`
  const veth = `aeth${n}h`
  try { ip('link', 'del', veth) } catch {}
  try { ip('netns', 'del', ns) } catch {}
  ip('netns', 'add', ns)
  ip('link', 'add', veth, 'type', 'veth', 'peer', 'name', 'eth0', 'netns', ns)
  ip('addr', 'add', '192.88.97.1/24', 'dev', veth)
  ip('link', 'set', veth, 'up')
  for (const a of [`${WEB}/24`, `${DNS}/24`, '192.88.97.90/24', '192.88.97.91/24']) ip('-n', ns, 'addr', 'add', a, 'dev', 'eth0')
  ip('-n', ns, 'link', 'set', 'eth0', 'up')
  ip('-n', ns, 'link', 'set', 'lo', 'up')
  const script = fileURLToPath(new URL('./egress-remote.cjs', import.meta.url))
  const proc = spawn('ip', ['netns', 'exec', ns, process.execPath, script, WEB, DNS, '192.88.97.90', '192.88.97.91',
    `api.tls.test=${WEB},plain.tls.test=${WEB}`, certDir], { stdio: ['ignore', 'pipe', 'inherit'] })
  await new Promise((res, rej) => {
    proc.stdout.once('data', res)
    proc.once('exit', (c) => rej(new Error(`remote servers exited ${c}`)))
  })
  return { ns, veth, proc }
}

before(async () => {
  makeCerts()
  node = await startNode({
    apiKey, bin: process.env.AENV_E2E_BIN || undefined, tag: 'aenv-e2e-tls-',
    env: { AENV_NETWORK_DNS: DNS, AENV_NETWORK_EGRESS_UPSTREAM_CA: join(certDir, 'up-ca.pem') },
  })
  skipReason = node.skip
  if (skipReason) return
  process.env.E2B_API_URL = node.url
  process.env.E2B_SANDBOX_URL = node.url
  process.env.E2B_API_KEY = apiKey
  remote = await setupRemote(Number(node.net.bridge.slice(3)))
})

after(async () => {
  if (remote) {
    remote.proc.kill('SIGKILL')
    try { ip('link', 'del', remote.veth) } catch {}
    try { ip('netns', 'del', remote.ns) } catch {}
  }
  await stopNode(node)
  if (certDir) rmSync(certDir, { recursive: true, force: true })
})

async function sh(sbx, cmd) {
  const r = await sbx.commands.run(`(${cmd}) 2>&1; true`, { timeoutMs: 30_000 })
  return r.stdout
}

const curl = (host, extra = '') => `curl -sS --max-time 10 ${extra} https://${host}/`
const python = (host) => `python3 -c "import urllib.request; print(urllib.request.urlopen('https://${host}/', timeout=10).read().decode())"`
const nodejs = (host) => `node -e "require('https').get('https://${host}/', (r) => r.pipe(process.stdout)).on('error', (e) => console.log(e.message))"`

test('network.rules transforms over HTTPS: curl, python3 and node trust the node CA', { timeout: 300_000 }, async (t) => {
  if (skipReason) return t.skip(skipReason)
  const secret = 'tls-' + randomBytes(8).toString('hex')
  await Secret.create('tls-key', secret)
  const sbx = await Sandbox.create('base', {
    timeoutMs: 180_000,
    network: {
      allowOut: ['api.tls.test', 'plain.tls.test'],
      denyOut: ({ allTraffic }) => [allTraffic],
      rules: { 'api.tls.test': [{ transform: { headers: { Authorization: `Bearer ${Secret.fill('tls-key')}` } } }] },
    },
  })
  try {
    const want = new RegExp(`^https host=api\\.tls\\.test auth=Bearer ${secret}$`, 'm')
    assert.match(await sh(sbx, curl('api.tls.test')), want, 'curl')
    assert.match(await sh(sbx, curl('api.tls.test', "-H 'Authorization: mine'")), want, 'the rule replaces the header')
    assert.match(await sh(sbx, python('api.tls.test')), want, 'python3')
    assert.match(await sh(sbx, nodejs('api.tls.test')), want, 'node')
    // The secret reaches the server, never the sandbox.
    assert.equal((await sh(sbx, `sudo grep -rls ${secret} /etc /usr/local/share/ca-certificates /proc/1/environ 2>/dev/null; env | grep -c ${secret}`)).trim(), '0')

    // No rules: TLS stays end to end (the server's own certificate, which the sandbox
    // does not trust unless told), and nothing is injected.
    assert.match(await sh(sbx, curl('plain.tls.test')), /certificate/)
    await sbx.files.write('/tmp/up-ca.pem', readFileSync(join(certDir, 'up-ca.pem'), 'utf8'))
    assert.match(await sh(sbx, curl('plain.tls.test', '--cacert /tmp/up-ca.pem')), /^https host=plain\.tls\.test auth=$/m)
    assert.match(await sh(sbx, curl('api.tls.test', '--cacert /tmp/up-ca.pem')), /certificate/, 'api.tls.test is the node CA\'s')
  } finally {
    await sbx.kill()
    await Secret.destroy('tls-key')
  }
})

test('rules added by updateNetwork get the CA too', { timeout: 300_000 }, async (t) => {
  if (skipReason) return t.skip(skipReason)
  const sbx = await Sandbox.create('base', { timeoutMs: 120_000 })
  try {
    assert.doesNotMatch(await sh(sbx, 'cat /usr/local/share/ca-certificates/aenv-egress-ca.crt'), /BEGIN CERTIFICATE/)
    await sbx.updateNetwork({
      allowOut: ['api.tls.test'],
      denyOut: ['0.0.0.0/0'],
      rules: { 'api.tls.test': [{ transform: { headers: { Authorization: 'Bearer later' } } }] },
    })
    assert.match(await sh(sbx, curl('api.tls.test')), /^https host=api\.tls\.test auth=Bearer later$/m)
    assert.match(await sh(sbx, python('api.tls.test')), /auth=Bearer later$/m)
  } finally {
    await sbx.kill()
  }
})
