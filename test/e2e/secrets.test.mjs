// SDK end-to-end test of secrets: the pinned e2b JS SDK (2.51.0) against a real `aenv serve`.
// Secret.create/getInfo/list/update/destroy; a sandbox created with envs holding
// Secret.fill(name) sees the value; the value is in no API answer, not in the node's log
// and not in its data files in the clear; bad input (a duplicate name, an oversized value,
// an unknown secret referenced at create) is refused. Skips, saying why, when not root or
// without an OCI runtime.
import { test, before, after } from 'node:test'
import assert from 'node:assert/strict'
import { randomBytes } from 'node:crypto'
import { readFileSync, readdirSync, statSync } from 'node:fs'
import { join } from 'node:path'

import { Sandbox, Secret } from 'e2b'

import { startNode, stopNode } from './lib.mjs'

const apiKey = 'e2b_' + randomBytes(20).toString('hex')
const runId = randomBytes(4).toString('hex')
const value = 'sk-e2e-' + randomBytes(16).toString('hex')

let node
let skipReason = ''

before(async () => {
  node = await startNode({ apiKey, bin: process.env.AENV_E2E_BIN || undefined, tag: 'aenv-e2e-sec-' })
  skipReason = node.skip
  if (skipReason) return
  process.env.E2B_API_URL = node.url
  process.env.E2B_SANDBOX_URL = node.url
  process.env.E2B_API_KEY = apiKey
})

after(async () => {
  await stopNode(node)
})

// files lists the regular files under dir, not crossing into sandboxes' mounts.
function files(dir, outList = []) {
  for (const e of readdirSync(dir, { withFileTypes: true })) {
    const p = join(dir, e.name)
    if (e.isDirectory() && e.name !== 'sandboxes' && e.name !== 'templates') files(p, outList)
    else if (e.isFile() && statSync(p).size < 64 << 20) outList.push(p)
  }
  return outList
}

test('secrets: API, injection into a sandbox, never returned or logged', { timeout: 300_000 }, async (t) => {
  if (skipReason) return t.skip(skipReason)
  const name = 'e2e-key-' + runId
  const answers = []
  const created = await Secret.create(name, value, { metadata: { purpose: 'e2e' } })
  answers.push(created)
  assert.equal(created.name, name)
  assert.equal(created.version, 1)
  assert.deepEqual(created.metadata, { purpose: 'e2e' })
  answers.push(await Secret.getInfo(name))
  answers.push(await Secret.getInfo(created.secretId))
  const page = await Secret.list().nextItems()
  answers.push(page)
  assert.ok(page.some((s) => s.secretId === created.secretId))

  await assert.rejects(Secret.create(name, 'x'), /exists/)
  await assert.rejects(Secret.create('e2e-big-' + runId, 'x'.repeat(65 * 1024)), /limit/)
  assert.equal(await Secret.exists('e2e-big-' + runId), false)

  const sbx = await Sandbox.create('base', { envs: { API_KEY: Secret.fill(name), AUTH: 'Bearer ' + Secret.fill(name) } })
  try {
    assert.equal((await sbx.commands.run('echo "$API_KEY"')).stdout, value + '\n')
    assert.equal((await sbx.commands.run('echo "$AUTH"')).stdout, 'Bearer ' + value + '\n')
    answers.push(await Sandbox.getInfo(sbx.sandboxId))
    answers.push(await Sandbox.list().nextItems())
  } finally {
    await sbx.kill()
  }
  await assert.rejects(Sandbox.create('base', { envs: { K: Secret.fill('e2e-none-' + runId) } }), /not found/)

  const updated = await Secret.update(name, value + '-v2')
  assert.equal(updated.version, 2)
  answers.push(updated)
  const sbx2 = await Sandbox.create('base', { envs: { API_KEY: Secret.fill(name) } })
  try {
    assert.equal((await sbx2.commands.run('echo "$API_KEY"')).stdout, value + '-v2\n')
  } finally {
    await sbx2.kill()
  }

  assert.equal(await Secret.destroy(name), true)
  assert.equal(await Secret.destroy(name), false)
  assert.equal(await Secret.exists(name), false)

  for (const a of answers) assert.ok(!JSON.stringify(a).includes(value), 'an API answer carries the value: ' + JSON.stringify(a))
  assert.ok(!node.log().includes(value), "the node's log carries the value")
  for (const f of files(node.dataDir)) {
    assert.ok(!readFileSync(f).includes(value), `${f} holds the value in the clear`)
  }
})
