// Shared helpers for the SDK end-to-end tests: start ../../bin/envd on a free port, optionally with
// its own passwd/group files (so a `user` account exists without touching the host), and /init it.
import { spawn } from 'node:child_process'
import { mkdtempSync, mkdirSync, writeFileSync, chmodSync, chownSync, rmSync, existsSync } from 'node:fs'
import { createServer } from 'node:net'
import { tmpdir, userInfo } from 'node:os'
import { dirname, join, resolve } from 'node:path'
import { fileURLToPath } from 'node:url'

const here = dirname(fileURLToPath(import.meta.url))
export const binDir = resolve(here, '../../bin')

export const isRoot = typeof process.getuid === 'function' && process.getuid() === 0

export async function freePort() {
  return await new Promise((res, rej) => {
    const srv = createServer()
    srv.unref()
    srv.on('error', rej)
    srv.listen(0, '127.0.0.1', () => {
      const { port } = srv.address()
      srv.close(() => res(port))
    })
  })
}

export const sleep = (ms) => new Promise((r) => setTimeout(r, ms))

/**
 * Start envd. With `withUser` (root only) a temporary passwd/group adds `user` (uid/gid 1000-ish,
 * home under a temp dir) next to root. Returns {url, port, dir, home, stop, init(body)}.
 */
export async function startEnvd({ withUser = false, args = [] } = {}) {
  const bin = join(binDir, 'envd')
  if (!existsSync(bin)) throw new Error(`${bin} is missing: run 'make binaries' first`)
  const dir = mkdtempSync(join(tmpdir(), 'envd-e2e-'))
  chmodSync(dir, 0o755)
  const extra = []
  let home = dir
  let user = isRoot ? 'root' : userInfo().username
  if (withUser && isRoot) {
    const uid = 1000
    home = join(dir, 'home', 'user')
    mkdirSync(home, { recursive: true })
    chmodSync(join(dir, 'home'), 0o755)
    chownSync(home, uid, uid)
    writeFileSync(join(dir, 'passwd'),
      `root:x:0:0:root:/root:/bin/bash\nuser:x:${uid}:${uid}:user:${home}:/bin/bash\n`)
    writeFileSync(join(dir, 'group'), `root:x:0:\nuser:x:${uid}:\n`)
    extra.push('--passwd', join(dir, 'passwd'), '--group', join(dir, 'group'))
    user = 'user'
  }
  const port = await freePort()
  const child = spawn(bin, ['--port', String(port), '--host', '127.0.0.1', ...extra, ...args], {
    stdio: ['ignore', 'inherit', 'inherit'],
  })
  let exited = null
  child.on('exit', (code, sig) => { exited = { code, sig } })
  const url = `http://localhost:${port}`
  const deadline = Date.now() + 10_000
  for (;;) {
    if (exited) throw new Error(`envd exited early: ${JSON.stringify(exited)}`)
    try {
      const r = await fetch(`${url}/health`)
      if (r.status === 204) break
    } catch {}
    if (Date.now() > deadline) throw new Error('envd did not become healthy within 10 s')
    await sleep(50)
  }
  const version = (await fetch(`${url}/health`)).headers.get('x-envd-version')
  return {
    url, port, dir, home, user, version, child,
    async init(body, token) {
      const r = await fetch(`${url}/init`, {
        method: 'POST',
        headers: { 'content-type': 'application/json', ...(token ? { 'x-access-token': token } : {}) },
        body: JSON.stringify(body),
      })
      if (r.status !== 204) throw new Error(`/init: ${r.status} ${await r.text()}`)
    },
    async stop() {
      if (!exited) {
        child.kill('SIGTERM')
        for (let i = 0; i < 100 && !exited; i++) await sleep(50)
        if (!exited) child.kill('SIGKILL')
      }
      rmSync(dir, { recursive: true, force: true })
    },
  }
}
