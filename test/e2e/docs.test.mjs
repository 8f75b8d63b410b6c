// The SDK examples of the docs, run: every ```js block of README.md and docs/*.md runs as a
// module (top-level await, `import ... from 'e2b'` resolved from this directory) with the
// pinned e2b SDK against a real `aenv serve`, with E2B_API_URL, E2B_SANDBOX_URL,
// E2B_API_KEY and E2B_VOLUME_API_URL set as the docs say, and must exit 0. The shell
// examples are run by test/integration TestDocsExamples. Skips, saying why, when not root.
import { test, before, after } from 'node:test'
import assert from 'node:assert/strict'
import { spawnSync } from 'node:child_process'
import { randomBytes } from 'node:crypto'
import { readFileSync, readdirSync, writeFileSync, rmSync } from 'node:fs'
import { basename, dirname, join, resolve } from 'node:path'
import { fileURLToPath } from 'node:url'

import { startNode, stopNode } from './lib.mjs'

const here = dirname(fileURLToPath(import.meta.url))
const repo = resolve(here, '../..')
const apiKey = 'e2b_' + randomBytes(20).toString('hex')

// jsBlocks returns {where, code} for each ```js block of the docs.
function jsBlocks() {
  const files = [join(repo, 'README.md'), ...readdirSync(join(repo, 'docs')).filter((f) => f.endsWith('.md')).map((f) => join(repo, 'docs', f))]
  const out = []
  for (const f of files) {
    const lines = readFileSync(f, 'utf8').split('\n')
    let cur = null
    let imports = ''
    lines.forEach((line, i) => {
      const t = line.trim()
      if (t.startsWith('```')) {
        if (cur) {
          if (cur.lang === 'js') {
            // A block without imports continues the file's previous one, as a reader would.
            let code = cur.lines.join('\n')
            if (!/from 'e2b'/.test(code)) code = imports + '\n' + code
            else imports = cur.lines.filter((l) => l.startsWith('import ')).join('\n')
            out.push({ where: `${basename(f)}:${cur.line}`, code })
          }
          cur = null
        } else {
          cur = { lang: t.slice(3), line: i + 1, lines: [] }
        }
        return
      }
      if (cur) cur.lines.push(line)
    })
  }
  return out
}

let node
let skipReason = ''

before(async () => {
  node = await startNode({ apiKey, bin: process.env.AENV_E2E_BIN || undefined, tag: 'aenv-e2e-docs-' })
  skipReason = node.skip
})

after(async () => {
  await stopNode(node)
})

const blocks = jsBlocks()

test('the docs show SDK examples', () => {
  assert.ok(blocks.length >= 4, `only ${blocks.length} js blocks found`)
})

for (const b of blocks) {
  test(`docs example ${b.where}`, { timeout: 180_000 }, (t) => {
    if (skipReason) return t.skip(skipReason)
    const file = join(here, `.docs-example-${b.where.replace(/[^a-z0-9]/gi, '-')}.mjs`)
    writeFileSync(file, b.code + '\n')
    try {
      const r = spawnSync(process.execPath, [file], {
        cwd: here,
        encoding: 'utf8',
        timeout: 170_000,
        env: {
          ...process.env,
          E2B_API_URL: node.url, E2B_SANDBOX_URL: node.url, E2B_VOLUME_API_URL: node.url, E2B_API_KEY: apiKey,
        },
      })
      assert.equal(r.status, 0, `${b.where} failed (${r.status ?? r.signal}):\n${r.stdout}\n${r.stderr}`)
    } finally {
      rmSync(file, { force: true })
    }
  })
}
