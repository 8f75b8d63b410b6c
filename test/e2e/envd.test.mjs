// envd alone, driven by the real e2b SDK (pinned e2b@2.51.0) in debug mode: no control plane, the
// SDK talks straight to envd. E2B_SANDBOX_URL points it at the port this file started envd on
// (debug mode alone would pin http://localhost:49983).
import { test, before, after, describe } from 'node:test'
import assert from 'node:assert/strict'
import { gzipSync } from 'node:zlib'
import { Readable } from 'node:stream'

import {
  Sandbox, CommandExitError, FileNotFoundError, TimeoutError, AuthenticationError, NotFoundError,
  FilesystemEventType, getSignature,
} from 'e2b'
import { startEnvd, isRoot, sleep } from './lib.mjs'

const TOKEN = 'envd-e2e-token-' + Math.random().toString(16).slice(2)

let secured // envd with /init: access token, default user `user` (when root), env vars
let plain // envd as started, no /init: what `Sandbox.create()` in debug mode sees
let sbx // SDK sandbox bound to `secured`

before(async () => {
  process.env.E2B_DEBUG = 'true'
  secured = await startEnvd({ withUser: true })
  await secured.init({
    envVars: { FOO: 'from-init', E2B_TEST_VAR: 'x' },
    accessToken: TOKEN,
    defaultUser: secured.user,
    defaultWorkdir: secured.home,
    timestamp: new Date().toISOString(),
  })
  // Debug mode never calls the API, so build the sandbox object the way Sandbox.create would after
  // a real create: with the envd token and the version the daemon reports.
  sbx = new Sandbox({
    sandboxId: 'debug_sandbox_id',
    envdVersion: secured.version,
    envdAccessToken: TOKEN,
    sandboxUrl: secured.url,
    debug: true,
  })
  plain = await startEnvd()
})

after(async () => {
  await secured?.stop()
  await plain?.stop()
})

describe('debug mode', () => {
  test('Sandbox.create() in debug mode talks to envd directly', async () => {
    process.env.E2B_SANDBOX_URL = plain.url
    try {
      const s = await Sandbox.create()
      assert.equal(s.sandboxId, 'debug_sandbox_id')
      const r = await s.commands.run('echo hi')
      assert.equal(r.exitCode, 0)
      assert.equal(r.stdout, 'hi\n')
      assert.equal(await s.isRunning(), true)
    } finally {
      delete process.env.E2B_SANDBOX_URL
    }
  })

  test('envd reports a dotted semver version', () => {
    assert.match(secured.version, /^\d+\.\d+\.\d+$/)
  })
})

describe('commands', () => {
  test('run: stdout, exit code 0, user, home, env', async () => {
    const r = await sbx.commands.run('echo hi; echo $USER; id -u; pwd; echo $FOO $E2B_SANDBOX $BAR', { envs: { BAR: 'per-cmd' } })
    assert.equal(r.exitCode, 0)
    assert.equal(r.stderr, '')
    const uid = isRoot ? 1000 : process.getuid()
    assert.equal(r.stdout, `hi\n${secured.user}\n${uid}\n${secured.home}\nfrom-init true per-cmd\n`)
  })

  test('run: non-zero exit throws CommandExitError with stdout and stderr', async () => {
    await assert.rejects(sbx.commands.run('echo out; echo err >&2; exit 3'), (e) => {
      assert.ok(e instanceof CommandExitError, String(e))
      assert.equal(e.exitCode, 3)
      assert.equal(e.stdout, 'out\n')
      assert.equal(e.stderr, 'err\n')
      assert.match(e.message, /exit status 3/)
      return true
    })
  })

  test('run: cwd and user root', async () => {
    const r = await sbx.commands.run('pwd; id -u', { cwd: '/tmp', user: isRoot ? 'root' : undefined })
    assert.equal(r.stdout, `/tmp\n${process.getuid()}\n`)
  })

  test('run: a missing cwd is an invalid argument', async () => {
    await assert.rejects(sbx.commands.run('true', { cwd: '/definitely/not/here' }), /does not exist/)
  })

  test('run: an unknown user is an authentication error', async () => {
    await assert.rejects(sbx.commands.run('true', { user: 'nosuchuser' }), AuthenticationError)
  })

  test('run: streaming callbacks and large output', async () => {
    let seen = 0
    const r = await sbx.commands.run('head -c 3000000 /dev/zero | tr "\\0" a', { onStdout: (d) => { seen += d.length } })
    assert.equal(r.stdout.length, 3_000_000)
    assert.equal(seen, 3_000_000)
  })

  test('background + list + kill', async () => {
    const h = await sbx.commands.run('sleep 100', { background: true })
    assert.ok(h.pid > 0)
    const list = await sbx.commands.list()
    assert.ok(list.some((p) => p.pid === h.pid && p.args.includes('sleep 100')), JSON.stringify(list))
    assert.equal(await h.kill(), true)
    await assert.rejects(h.wait(), (e) => e instanceof CommandExitError && e.exitCode === -1)
    assert.equal(await sbx.commands.kill(h.pid), false)
    assert.equal(await sbx.commands.kill(999999), false)
  })

  test('connect re-attaches to a running process', async () => {
    const h = await sbx.commands.run('for i in 1 2 3 4 5; do echo tick$i; sleep 0.2; done', { background: true })
    await h.disconnect()
    const again = await sbx.commands.connect(h.pid)
    const r = await again.wait()
    assert.equal(r.exitCode, 0)
    assert.match(r.stdout, /tick5\n$/)
  })

  test('sendStdin and closeStdin', async () => {
    const h = await sbx.commands.run('cat', { background: true, stdin: true })
    await sbx.commands.sendStdin(h.pid, 'hello ')
    await sbx.commands.sendStdin(h.pid, 'world\n')
    await sbx.commands.closeStdin(h.pid)
    const r = await h.wait()
    assert.equal(r.stdout, 'hello world\n')
  })

  test('timeoutMs kills the process', async () => {
    const start = Date.now()
    await assert.rejects(sbx.commands.run('sleep 30', { timeoutMs: 700 }), TimeoutError)
    assert.ok(Date.now() - start < 10_000)
    await sleep(200)
    const list = await sbx.commands.list()
    assert.ok(!list.some((p) => p.args.includes('sleep 30')), 'timed-out process still running')
  })

  test('a process survives its client going away', async () => {
    const h = await sbx.commands.run('sleep 1; echo done', { background: true, timeoutMs: 0 })
    await h.disconnect()
    const r = await (await sbx.commands.connect(h.pid)).wait()
    assert.equal(r.stdout, 'done\n')
  })
})

describe('pty', () => {
  test('create, sendInput, resize, kill', async () => {
    let out = ''
    const dec = new TextDecoder()
    const h = await sbx.pty.create({ cols: 80, rows: 24, onData: (d) => { out += dec.decode(d) }, timeoutMs: 30_000 })
    await sbx.pty.sendInput(h.pid, new TextEncoder().encode('echo $((6*7)); stty size\n'))
    for (let i = 0; i < 100 && !/24 80/.test(out); i++) await sleep(50)
    assert.match(out, /42/)
    assert.match(out, /24 80/)
    await sbx.pty.resize(h.pid, { cols: 100, rows: 30 })
    await sbx.pty.sendInput(h.pid, new TextEncoder().encode('stty size\n'))
    for (let i = 0; i < 100 && !/30 100/.test(out); i++) await sleep(50)
    assert.match(out, /30 100/)
    assert.equal(await sbx.pty.kill(h.pid), true)
    await assert.rejects(h.wait(), CommandExitError)
  })

  test('exit ends the session with the exit code', async () => {
    const h = await sbx.pty.create({ cols: 80, rows: 24, onData: () => {} })
    await sbx.pty.sendInput(h.pid, new TextEncoder().encode('exit 0\n'))
    const r = await h.wait()
    assert.equal(r.exitCode, 0)
  })
})

describe('files', () => {
  test('write and read text, bytes, blob, stream', async () => {
    const info = await sbx.files.write('hello.txt', 'hello world')
    assert.equal(info.path, `${secured.home}/hello.txt`)
    assert.equal(info.name, 'hello.txt')
    assert.equal(await sbx.files.read('hello.txt'), 'hello world')
    assert.equal(await sbx.files.read(`${secured.home}/hello.txt`), 'hello world')
    const bytes = await sbx.files.read('hello.txt', { format: 'bytes' })
    assert.deepEqual(Buffer.from(bytes), Buffer.from('hello world'))
    const blob = await sbx.files.read('hello.txt', { format: 'blob' })
    assert.equal(await blob.text(), 'hello world')

    const bin = Buffer.alloc(256 * 1024)
    for (let i = 0; i < bin.length; i++) bin[i] = (i * 7) & 0xff
    await sbx.files.write('dir/bin.dat', new Uint8Array(bin).buffer)
    const stream = await sbx.files.read('dir/bin.dat', { format: 'stream' })
    const chunks = []
    for await (const c of stream) chunks.push(Buffer.from(c))
    assert.deepEqual(Buffer.concat(chunks), bin)

    // Owned by the acting user, parents too.
    const st = await sbx.files.getInfo('dir/bin.dat')
    assert.equal(st.owner, secured.user)
    assert.equal((await sbx.files.getInfo('dir')).owner, secured.user)
    assert.equal(st.size, bin.length)
  })

  test('write from a stream and with gzip; read with gzip', async () => {
    await sbx.files.write('streamed.txt', Readable.toWeb(Readable.from([Buffer.from('a'), Buffer.from('b')])))
    assert.equal(await sbx.files.read('streamed.txt'), 'ab')
    await sbx.files.write('gz.txt', 'compressed body', { gzip: true })
    assert.equal(await sbx.files.read('gz.txt', { gzip: true }), 'compressed body')
    const r = await fetch(`${secured.url}/files?path=gz.txt`, { headers: { 'x-access-token': TOKEN, 'accept-encoding': 'gzip' } })
    assert.equal(r.headers.get('content-encoding'), 'gzip')
  })

  test('write several files keeps their relative paths', async () => {
    const res = await sbx.files.write([
      { path: '/tmp/envd-e2e-multi/a.txt', data: 'A' },
      { path: 'multi/b/c.txt', data: new TextEncoder().encode('C').buffer },
    ])
    assert.deepEqual(res.map((f) => f.path).sort(), [`${secured.home}/multi/b/c.txt`, '/tmp/envd-e2e-multi/a.txt'].sort())
    assert.equal(await sbx.files.read('multi/b/c.txt'), 'C')
    assert.equal(await sbx.files.read('/tmp/envd-e2e-multi/a.txt'), 'A')
    await sbx.files.remove('/tmp/envd-e2e-multi')
  })

  test('read a missing file throws FileNotFoundError', async () => {
    await assert.rejects(sbx.files.read('nope.txt'), FileNotFoundError)
  })

  test('list with depth, exists, makeDir, rename, remove, getInfo', async () => {
    assert.equal(await sbx.files.makeDir('tree/a/b'), true)
    assert.equal(await sbx.files.makeDir('tree/a/b'), false)
    await sbx.files.write('tree/a/b/f.txt', 'f')
    await sbx.files.write('tree/top.txt', 'top')

    const one = await sbx.files.list('tree')
    assert.deepEqual(one.map((e) => [e.name, e.type]), [['a', 'dir'], ['top.txt', 'file']])
    const deep = await sbx.files.list('tree', { depth: 3 })
    assert.deepEqual(deep.map((e) => e.path), [
      `${secured.home}/tree/a`, `${secured.home}/tree/a/b`, `${secured.home}/tree/a/b/f.txt`, `${secured.home}/tree/top.txt`])
    await assert.rejects(sbx.files.list('tree/missing'), FileNotFoundError)

    assert.equal(await sbx.files.exists('tree/top.txt'), true)
    assert.equal(await sbx.files.exists('/nope'), false)

    const moved = await sbx.files.rename('tree/top.txt', 'tree/renamed/top2.txt')
    assert.equal(moved.path, `${secured.home}/tree/renamed/top2.txt`)
    assert.equal(await sbx.files.exists('tree/top.txt'), false)
    await assert.rejects(sbx.files.rename('tree/nothing', 'tree/x'), FileNotFoundError)

    const info = await sbx.files.getInfo('tree/renamed/top2.txt')
    assert.equal(info.type, 'file')
    assert.equal(info.size, 3)
    assert.equal(info.permissions, '-rw-r--r--')
    assert.ok(info.modifiedTime instanceof Date)

    await sbx.files.remove('tree')
    assert.equal(await sbx.files.exists('tree'), false)
  })

  test('file metadata (envd >= 0.6.2)', async () => {
    const info = await sbx.files.write('meta.txt', 'meta', { metadata: { owner: 'me', 'build.id': '42' } })
    assert.deepEqual(info.metadata, { owner: 'me', 'build.id': '42' })
    const st = await sbx.files.getInfo('meta.txt')
    assert.deepEqual(st.metadata, { owner: 'me', 'build.id': '42' })
    const listed = (await sbx.files.list('.')).find((e) => e.name === 'meta.txt')
    assert.equal(listed.metadata.owner, 'me')
    assert.equal((await sbx.files.getInfo('hello.txt')).metadata, undefined)
  })

  test('watchDir with includeEntry (envd >= 0.6.3)', async () => {
    await sbx.files.makeDir('watched2')
    const events = []
    const w = await sbx.files.watchDir('watched2', (e) => events.push(e), { includeEntry: true })
    await sbx.files.write('watched2/e.txt', 'entry')
    for (let i = 0; i < 60 && !events.some((e) => e.entry); i++) await sleep(50)
    await w.stop()
    const ev = events.find((e) => e.entry)
    assert.ok(ev, JSON.stringify(events))
    assert.equal(ev.entry.path, `${secured.home}/watched2/e.txt`)
  })

  test('watchDir, non-recursive and recursive', async () => {
    await sbx.files.makeDir('watched/sub')
    const events = []
    const w = await sbx.files.watchDir('watched', (e) => events.push(e))
    await sbx.files.write('watched/new.txt', 'x')
    for (let i = 0; i < 60 && !events.some((e) => e.name === 'new.txt'); i++) await sleep(50)
    await w.stop()
    assert.ok(events.some((e) => e.name === 'new.txt' && e.type === FilesystemEventType.CREATE), JSON.stringify(events))

    const rec = []
    const w2 = await sbx.files.watchDir('watched', (e) => rec.push(e), { recursive: true })
    await sbx.files.write('watched/sub/deep.txt', 'y')
    for (let i = 0; i < 60 && !rec.some((e) => e.name === 'sub/deep.txt'); i++) await sleep(50)
    await w2.stop()
    assert.ok(rec.some((e) => e.name === 'sub/deep.txt'), JSON.stringify(rec))
    await assert.rejects(sbx.files.watchDir('watched/missing', () => {}), FileNotFoundError)
  })
})

describe('signed URLs and tokens', () => {
  test('uploadUrl / downloadUrl with signatures', async () => {
    const up = await sbx.uploadUrl('signed.txt')
    assert.match(up, /signature=v1_/)
    const form = new FormData()
    form.append('file', new Blob(['signed content']), 'signed.txt')
    const r1 = await fetch(up, { method: 'POST', body: form })
    assert.equal(r1.status, 200, await r1.clone().text())
    const down = await sbx.downloadUrl('signed.txt', { useSignatureExpiration: 60 })
    assert.match(down, /signature_expiration=/)
    const r2 = await fetch(down)
    assert.equal(r2.status, 200)
    assert.equal(await r2.text(), 'signed content')
  })

  test('bad, expired and missing signatures are refused', async () => {
    const down = new URL(await sbx.downloadUrl('signed.txt'))
    down.searchParams.set('signature', 'v1_AAAA')
    assert.equal((await fetch(down)).status, 401)
    const { signature } = await getSignature({ path: 'signed.txt', operation: 'read', user: undefined, envdAccessToken: TOKEN })
    const expired = new URL(`${secured.url}/files`)
    expired.searchParams.set('path', 'signed.txt')
    expired.searchParams.set('signature', signature)
    expired.searchParams.set('signature_expiration', '1000')
    assert.equal((await fetch(expired)).status, 401)
    assert.equal((await fetch(`${secured.url}/files?path=signed.txt`)).status, 401)
  })

  test('RPCs without the token are unauthenticated', async () => {
    const anon = new Sandbox({ sandboxId: 'debug_sandbox_id', envdVersion: secured.version, sandboxUrl: secured.url, debug: true })
    await assert.rejects(anon.commands.run('true'), AuthenticationError)
    await assert.rejects(anon.files.read('hello.txt'), AuthenticationError)
    assert.equal(await anon.isRunning(), true) // /health is exempt
  })

  test('envs and metrics need the token', async () => {
    assert.equal((await fetch(`${secured.url}/envs`)).status, 401)
    const envs = await (await fetch(`${secured.url}/envs`, { headers: { 'x-access-token': TOKEN } })).json()
    assert.equal(envs.FOO, 'from-init')
    const m = await (await fetch(`${secured.url}/metrics`, { headers: { 'x-access-token': TOKEN } })).json()
    for (const k of ['ts', 'cpu_count', 'cpu_used_pct', 'mem_total', 'mem_used', 'mem_total_mib', 'mem_used_mib', 'disk_used', 'disk_total']) {
      assert.equal(typeof m[k], 'number', k)
    }
  })
})

describe('bad input', () => {
  test('kill of an unknown pid is false, not an error', async () => {
    assert.equal(await sbx.commands.kill(4_000_000), false)
  })

  test('connect to an unknown pid is NotFound', async () => {
    await assert.rejects(sbx.commands.connect(4_000_000), NotFoundError)
  })

  test('reading a directory is a 400', async () => {
    await sbx.files.makeDir('adir')
    await assert.rejects(sbx.files.read('adir'), /directory/)
  })
})
