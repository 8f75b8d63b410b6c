// SDK end-to-end test of template builds: the pinned e2b JS SDK (2.51.0) runs
// Template.build against a real `aenv serve` (single-server mode, real OCI sandboxes), with
// the base image served by a loopback registry this test starts (registry/main.go: an image
// made from the host's busybox-static and bash-static). Then Sandbox.create(<name>) runs on
// the built template. Skips (saying why) when not root or when no OCI runtime works here.
import { test, before, after } from 'node:test'
import assert from 'node:assert/strict'
import { spawn, execFileSync } from 'node:child_process'
import { randomBytes } from 'node:crypto'
import fs from 'node:fs'
import os from 'node:os'
import path from 'node:path'
import { fileURLToPath } from 'node:url'

import { Sandbox, Template, BuildError } from 'e2b'

import { startNode, stopNode } from './lib.mjs'

const root = path.resolve(path.dirname(fileURLToPath(import.meta.url)), '../..')
const apiKey = 'e2b_' + randomBytes(20).toString('hex')
const runId = randomBytes(4).toString('hex')

let skipReason = ''
let node // from startNode
let registry // { proc, image, dir }

// startRegistry builds and runs the loopback registry helper; it resolves once the image
// is pushed.
async function startRegistry() {
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'aenv-e2e-registry-'))
  const bin = path.join(dir, 'registry')
  execFileSync('go', ['build', '-o', bin, './test/e2e/registry'], { cwd: root, stdio: 'inherit' })
  const proc = spawn(bin, [], { stdio: ['ignore', 'pipe', 'inherit'] })
  let out = ''
  const image = await new Promise((resolve, reject) => {
    proc.on('exit', (code) => reject(new Error(`registry helper exited with ${code}: ${out}`)))
    proc.stdout.on('data', (d) => {
      out += d
      const m = out.match(/^READY (\S+) (\S+)$/m)
      if (m) resolve(m[2])
    })
  })
  proc.removeAllListeners('exit')
  return { proc, image, dir }
}

before(async () => {
  // AENV_E2E_LOG=FILE keeps the node's log for debugging a failure.
  node = await startNode({ apiKey, tag: 'aenv-e2e-tpl-', logFile: process.env.AENV_E2E_LOG || '' })
  skipReason = node.skip
  if (skipReason) return
  registry = await startRegistry()
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

function skipIfUnavailable(t) {
  if (skipReason) {
    t.skip(skipReason)
    return true
  }
  return false
}

test('Template.build from a registry image with steps, COPY and a start command; Sandbox.create(name)', { timeout: 300_000 }, async (t) => {
  if (skipIfUnavailable(t)) return
  const ctxDir = fs.mkdtempSync(path.join(os.tmpdir(), 'aenv-e2e-ctx-'))
  t.after(() => fs.rmSync(ctxDir, { recursive: true, force: true }))
  fs.writeFileSync(path.join(ctxDir, 'fixture.txt'), 'copied from the build context\n')
  fs.mkdirSync(path.join(ctxDir, 'conf'))
  fs.writeFileSync(path.join(ctxDir, 'conf', 'app.conf'), 'port=8080\n')

  const name = `e2e-tpl-${runId}`
  const logs = []
  const tpl = Template({ fileContextPath: ctxDir })
    .fromImage(registry.image)
    .setEnvs({ GREETING: 'hello', MODE: 'test' })
    .runCmd('echo "$GREETING from $(whoami)" > /home/user/greeting.txt')
    .setWorkdir('/home/user/app')
    .copy('fixture.txt', '/home/user/app/fixture.txt')
    .copy('conf', '/etc/myapp', { user: 'root', mode: 0o640 })
    .runCmd('id -u > uid.txt && stat -c %U fixture.txt > owner.txt')
    .runCmd('touch /etc/built-as-root', { user: 'root' })
    .setStartCmd('echo started > /home/user/app/started && sleep 3600', 'test -f /home/user/app/started')
  const info = await Template.build(tpl, name, { onBuildLogs: (e) => logs.push(e.message) })
  assert.equal(info.name, name)
  assert.match(info.templateId, /^[a-z0-9]+$/)
  assert.ok(logs.some((l) => l.includes('is ready')), logs.join('\n'))
  assert.equal(await Template.exists(name), true)
  assert.equal(await Template.exists(`nope-${runId}`), false)

  const sbx = await Sandbox.create(name, { timeoutMs: 60_000 })
  try {
    const run = async (cmd, opts) => (await sbx.commands.run(cmd, opts)).stdout
    assert.equal(await run('cat /home/user/greeting.txt'), 'hello from user\n')
    assert.equal(await run('pwd'), '/home/user/app\n')
    assert.equal(await run('echo "$GREETING $MODE $IMAGE_ENV"'), 'hello test from-image\n')
    assert.equal(await run('cat fixture.txt owner.txt uid.txt'), 'copied from the build context\nuser\n1000\n')
    assert.equal(await run('cat /etc/myapp/app.conf && stat -c "%U %a" /etc/myapp/app.conf', { user: 'root' }), 'port=8080\nroot 640\n')
    assert.equal(await run('test -f /etc/built-as-root && echo yes'), 'yes\n')
    // The start command ran during the build; its effect is part of the template.
    assert.equal(await run('cat started'), 'started\n')
    assert.equal(await sbx.files.read('/home/user/app/fixture.txt'), 'copied from the build context\n')
  } finally {
    await sbx.kill()
  }

  // A second build of the same name makes a new version of the same template, reusing
  // the uploaded files and the imported image.
  const again = await Template.build(
    Template({ fileContextPath: ctxDir }).fromImage(registry.image).copy('fixture.txt', '/home/user/f2.txt'),
    name)
  assert.equal(again.templateId, info.templateId)
  assert.notEqual(again.buildId, info.buildId)
  // E2B's name:tag form; a build without tags gets the default tag.
  const sbx2 = await Sandbox.create(`${name}:default`, { timeoutMs: 60_000 })
  try {
    assert.equal((await sbx2.commands.run('cat /home/user/f2.txt; test -e /home/user/greeting.txt || echo fresh')).stdout,
      'copied from the build context\nfresh\n')
  } finally {
    await sbx2.kill()
  }
})

test('Template.build failure: a failing step names the step and registers nothing', { timeout: 180_000 }, async (t) => {
  if (skipIfUnavailable(t)) return
  await assert.rejects(
    Template.build(Template().fromTemplate('base').runCmd('echo about to fail').runCmd('exit 3'), `e2e-fail-${runId}`),
    (err) => err instanceof BuildError && /step 2 .*exit code 3/.test(err.message),
  )
  assert.equal(await Template.exists(`e2e-fail-${runId}`), false)
  // Sandboxes still work after failed builds.
  const sbx = await Sandbox.create({ timeoutMs: 30_000 })
  try {
    assert.equal((await sbx.commands.run('echo ok')).stdout, 'ok\n')
  } finally {
    await sbx.kill()
  }
})

test('aenv build -f Dockerfile, then aenv template ls | logs | rm', { timeout: 300_000 }, async (t) => {
  if (skipIfUnavailable(t)) return
  const ctxDir = fs.mkdtempSync(path.join(os.tmpdir(), 'aenv-e2e-df-'))
  t.after(() => fs.rmSync(ctxDir, { recursive: true, force: true }))
  fs.writeFileSync(path.join(ctxDir, 'fixture.txt'), 'from the dockerfile context\n')
  fs.writeFileSync(path.join(ctxDir, 'Dockerfile'), [
    'ARG BASE',
    'FROM ${BASE}',
    'ENV APP_ENV=prod',
    'WORKDIR /srv',
    'COPY fixture.txt ./',
    'RUN echo "built $APP_ENV as $(whoami)" > built.txt',
    'EXPOSE 8080',
    'CMD ["sleep", "3600"]',
    '',
  ].join('\n'))
  const name = `e2e-cli-${runId}`
  const cli = (...args) => execFileSync(node.bin, ['--url', node.url, '--api-key', apiKey, ...args],
    { encoding: 'utf8', stdio: ['ignore', 'pipe', 'pipe'] })
  const out = execFileSync(node.bin, ['--url', node.url, '--api-key', apiKey, 'build', '--name', name,
    '--build-arg', `BASE=${registry.image}`, ctxDir], { encoding: 'utf8', stdio: ['ignore', 'pipe', 'pipe'] })
  void out

  const sbx = await Sandbox.create(name, { timeoutMs: 60_000 })
  try {
    const r = await sbx.commands.run('cat built.txt fixture.txt; whoami; pwd; stat -c %U fixture.txt; echo $APP_ENV')
    assert.equal(r.stdout, 'built prod as root\nfrom the dockerfile context\nuser\n/srv\nroot\nprod\n')
  } finally {
    await sbx.kill()
  }

  const list = JSON.parse(cli('template', 'ls', '-o', 'json'))
  const mine = list.find((x) => x.aliases.includes(name))
  assert.ok(mine, JSON.stringify(list))
  assert.equal(mine.buildStatus, 'ready')
  const logs = cli('template', 'logs', name)
  assert.match(logs, /RUN echo "built \$APP_ENV/)
  assert.match(logs, /is ready/)
  assert.equal(cli('template', 'rm', name).trim(), name)
  assert.equal(await Template.exists(name), false)

  // A bad Dockerfile fails before anything reaches the node.
  fs.writeFileSync(path.join(ctxDir, 'Dockerfile.bad'), 'FROM a AS b\nFROM c\n')
  assert.throws(() => cli('build', '-f', path.join(ctxDir, 'Dockerfile.bad'), '--name', `${name}-bad`, ctxDir),
    (err) => /multi-stage/.test(String(err.stderr)))
})
