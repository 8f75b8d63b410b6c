// temporary repro script (not a test); deleted after use
import { randomBytes } from 'node:crypto'
import { Sandbox, Template } from 'e2b'
import { startNode, stopNode } from './lib.mjs'
const apiKey = 'e2b_' + randomBytes(20).toString('hex')
const node = await startNode({ apiKey, logFile: '/tmp/e2e-repro/node.log' })
process.env.E2B_API_URL = node.url; process.env.E2B_SANDBOX_URL = node.url; process.env.E2B_API_KEY = apiKey
const withStart = process.argv[2] !== 'nostart'
let fails = 0
try {
  let name = 'base'
  if (withStart) {
    name = 'rp-' + randomBytes(3).toString('hex')
    const tpl = Template().fromTemplate('base').setStartCmd('echo started > /tmp/started && sleep 3600', 'test -f /tmp/started')
    await Template.build(tpl, name, {})
  }
  for (let i = 0; i < 25; i++) {
    const sbx = await Sandbox.create(name, { timeoutMs: 60_000 })
    try {
      for (let j = 0; j < 8; j++) {
        try {
          await sbx.commands.run(j % 2 ? 'whoami && echo $HOME' : 'echo hi')
          if (j == 3) { await sbx.files.write('/home/user/hello.txt', 'hello world'); await sbx.files.read('/home/user/hello.txt') }
        } catch (e) {
          fails++
          let c = e; const chain = []
          while (c) { chain.push(`${c.name}: ${c.message} ${c.code ?? ''}`); c = c.cause ?? c.rawError?.cause }
          console.log(`sandbox ${sbx.sandboxId} iter ${i} cmd ${j}:`, chain.join(' <- '))
        }
      }
    } finally { await sbx.kill() }
  }
} finally {
  await stopNode(node)
  console.log('fails', fails, 'start', withStart)
}
