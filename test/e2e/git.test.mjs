// SDK end-to-end test of the `base` template as E2B's: the pinned e2b JS SDK (2.51.0) runs its
// Git helper (sandbox.git) against a real `aenv serve` whose base is the Debian one `make base`
// builds, and checks the tools SDK code expects there (python3, node, curl, sudo, tput) as the
// default user. The repository is served inside the sandbox: a bare repository behind
// `git daemon` on the sandbox's loopback (git://) and the same repository by path; nothing
// outside the sandbox is reached. base-minimal (busybox + bash) is checked to stay available.
// Skips (saying why) when not root or when no OCI runtime works on this host.
import { test, before, after } from 'node:test'
import assert from 'node:assert/strict'
import { randomBytes } from 'node:crypto'

import { Sandbox } from 'e2b'

import { startNode, stopNode } from './lib.mjs'

const apiKey = 'e2b_' + randomBytes(20).toString('hex')

let skipReason = ''
let node // from startNode

before(async () => {
  node = await startNode({ apiKey, tag: 'aenv-e2e-git-' })
  skipReason = node.skip
  if (!skipReason) {
    process.env.E2B_API_URL = node.url
    process.env.E2B_SANDBOX_URL = node.url
    process.env.E2B_API_KEY = apiKey
  }
})

after(async () => {
  await stopNode(node)
})

test('base has python3, node, curl, passwordless sudo and tput for user', { timeout: 120_000 }, async (t) => {
  if (skipReason) return t.skip(skipReason)
  const sbx = await Sandbox.create({ timeoutMs: 60_000 })
  try {
    const run = async (cmd) => {
      try {
        return (await sbx.commands.run(cmd)).stdout.trim()
      } catch (err) {
        throw new Error(`${cmd}: exit ${err.exitCode}: ${err.stderr}`)
      }
    }
    assert.equal(await run('whoami'), 'user')
    assert.equal(await run(`python3 -c 'import json, sys; print(json.dumps({"v": sys.version_info[0]}))'`), '{"v": 3}')
    assert.equal(await run(`node -e 'console.log([1, 2, 3].map((x) => x * 2).join(","))'`), '2,4,6')
    // sudo without a password, as on E2B: root, and back to user.
    assert.equal(await run('sudo -n true && sudo -n id -u && id -u'), '0\n1000')
    // The host name (the sandbox's id) resolves, so sudo neither warns nor waits for DNS.
    const r = await sbx.commands.run('sudo -n true; getent hosts "$(hostname)"')
    assert.equal(r.stderr, '')
    assert.match(r.stdout, /^127\.0\.1\.1\s/)
    assert.equal(await run('sudo -n sh -c "echo from-root > /etc/aenv-e2e" && cat /etc/aenv-e2e'), 'from-root')
    // tput without a terminal (the profile sets TERM when there is none).
    assert.match(await run('tput cols'), /^\d+$/)
    assert.equal(await run('tput setaf 1 | od -An -c | tr -d " "'), '033[31m')
    // curl over HTTP to a server in the sandbox; the CA bundle is there for HTTPS.
    await sbx.commands.run('mkdir -p /tmp/www && echo served > /tmp/www/f && cd /tmp/www && python3 -m http.server 8123 --bind 127.0.0.1',
      { background: true })
    let body = ''
    for (let i = 0; i < 50 && body !== 'served'; i++) {
      body = (await sbx.commands.run('curl -fsS http://127.0.0.1:8123/f || true')).stdout.trim()
      if (body !== 'served') await new Promise((r) => setTimeout(r, 100))
    }
    assert.equal(body, 'served')
    assert.equal(await run('test -s /etc/ssl/certs/ca-certificates.crt && echo ok'), 'ok')
    assert.match(await run('ps -eo comm='), /^envd$/m) // procps sees the sandbox's processes
  } finally {
    await sbx.kill()
  }
})

test('Git helper: clone from git daemon, commit, push, status, clone by path', { timeout: 180_000 }, async (t) => {
  if (skipReason) return t.skip(skipReason)
  const sbx = await Sandbox.create({ timeoutMs: 120_000 })
  try {
    const srv = '/home/user/srv'
    const bare = `${srv}/project.git`
    // The "server": a bare repository with one commit, served by git daemon (push enabled).
    await sbx.git.init(bare, { bare: true, initialBranch: 'main' })
    await sbx.commands.run([
      'set -e', 'git init -q -b main /tmp/seed', 'cd /tmp/seed', 'echo "# project" > README.md',
      'git add README.md', 'git -c user.name=seed -c user.email=seed@example.invalid commit -q -m seed',
      `git push -q ${bare} main`,
    ].join('\n'))
    await sbx.commands.run(`git daemon --reuseaddr --listen=127.0.0.1 --port=9418 --base-path=${srv} --export-all --enable=receive-pack ${srv}`,
      { background: true })
    const url = 'git://127.0.0.1:9418/project.git'
    const work = '/home/user/work'
    let cloned = false
    for (let i = 0; i < 50 && !cloned; i++) {
      try {
        await sbx.git.clone(url, { path: work })
        cloned = true
      } catch (err) {
        if (i === 49) throw err
        await new Promise((r) => setTimeout(r, 100)) // the daemon is still starting
      }
    }
    let st = await sbx.git.status(work)
    assert.equal(st.currentBranch, 'main')
    assert.equal(st.isClean, true)
    assert.equal(await sbx.git.remoteGet(work, 'origin'), url)

    // Change, stage, commit, push: status follows each step.
    await sbx.files.write(`${work}/hello.txt`, 'hello from the sandbox\n')
    await sbx.files.write(`${work}/README.md`, '# project\nchanged\n')
    st = await sbx.git.status(work)
    assert.equal(st.isClean, false)
    assert.equal(st.untrackedCount, 1)
    assert.deepEqual(st.fileStatus.map((f) => [f.name, f.status]).sort(), [['README.md', 'modified'], ['hello.txt', 'untracked']])
    await sbx.git.add(work, { all: true })
    st = await sbx.git.status(work)
    assert.equal(st.stagedCount, 2)
    assert.equal(st.hasStaged, true)
    await sbx.git.commit(work, 'add hello', { authorName: 'Sandbox User', authorEmail: 'user@example.invalid' })
    st = await sbx.git.status(work)
    assert.equal(st.isClean, true)
    assert.equal(st.upstream, 'origin/main')
    assert.equal(st.ahead, 1)
    await sbx.git.push(work)
    st = await sbx.git.status(work)
    assert.equal(st.ahead, 0)
    assert.equal(st.behind, 0)

    // The server has the commit; a second clone, by path, sees it on a new branch too.
    const log = await sbx.commands.run(`git --git-dir=${bare} log --format='%an|%s' main`)
    assert.equal(log.stdout, 'Sandbox User|add hello\nseed|seed\n')
    await sbx.git.createBranch(work, 'feature')
    await sbx.git.push(work, { remote: 'origin', branch: 'feature', setUpstream: true })
    const second = '/home/user/second'
    await sbx.git.clone(bare, { path: second, branch: 'feature', depth: 1 })
    assert.equal((await sbx.commands.run(`cat ${second}/hello.txt`)).stdout, 'hello from the sandbox\n')
    const branches = await sbx.git.branches(second)
    assert.equal(branches.currentBranch, 'feature')
  } finally {
    await sbx.kill()
  }
})

test('base-minimal stays available: busybox and bash', { timeout: 60_000 }, async (t) => {
  if (skipReason) return t.skip(skipReason)
  const sbx = await Sandbox.create('base-minimal', { timeoutMs: 30_000 })
  try {
    const r = await sbx.commands.run('whoami; readlink /bin/ls; command -v python3 || echo no-python')
    assert.equal(r.stdout, 'user\n/bin/busybox\nno-python\n')
  } finally {
    await sbx.kill()
  }
})
