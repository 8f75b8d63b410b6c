// SDK-side envd benchmarks (not a test): node bench/envd-bench.mjs [iterations]
// Starts ../../bin/envd with a `user` account (when root) and reports medians through the pinned SDK:
// commands.run('true') round trip, stdout streaming throughput, 100 MB files.write / files.read.
import { Sandbox } from 'e2b'
import { startEnvd } from '../lib.mjs'

const N = Number(process.argv[2] ?? 300)
const median = (xs) => { const s = [...xs].sort((a, b) => a - b); return s[Math.floor(s.length / 2)] }
const pct = (xs, p) => { const s = [...xs].sort((a, b) => a - b); return s[Math.min(s.length - 1, Math.floor(s.length * p))] }

const envd = await startEnvd({ withUser: true })
await envd.init({ defaultUser: envd.user, defaultWorkdir: envd.home })
process.env.E2B_DEBUG = 'true'
const sbx = new Sandbox({ sandboxId: 'debug_sandbox_id', envdVersion: envd.version, sandboxUrl: envd.url, debug: true })
try {
  for (let i = 0; i < 20; i++) await sbx.commands.run('true') // warm up
  const lat = []
  for (let i = 0; i < N; i++) {
    const t0 = performance.now()
    await sbx.commands.run('true')
    lat.push(performance.now() - t0)
  }
  console.log(`commands.run('true') as ${envd.user}: p50 ${median(lat).toFixed(2)} ms, p90 ${pct(lat, 0.9).toFixed(2)} ms (n=${N})`)

  const MB = 1 << 20
  const rates = []
  for (let i = 0; i < 5; i++) {
    let n = 0
    const h = await sbx.commands.run('head -c 268435456 /dev/zero', { background: true, timeoutMs: 0, onStdout: (d) => { n += d.length } })
    const t1 = performance.now()
    await h.wait()
    rates.push(n / MB / ((performance.now() - t1) / 1000))
  }
  console.log(`stdout streaming through the SDK: median ${median(rates).toFixed(0)} MB/s`)

  const data = new Uint8Array(100 * MB)
  for (let i = 0; i < data.length; i += 4096) data[i] = i & 0xff
  const up = [], down = []
  for (let i = 0; i < 5; i++) {
    let t0 = performance.now()
    await sbx.files.write('big.bin', data.buffer)
    up.push(100 / ((performance.now() - t0) / 1000))
    t0 = performance.now()
    const got = await sbx.files.read('big.bin', { format: 'bytes' })
    down.push(100 / ((performance.now() - t0) / 1000))
    if (got.length !== data.length) throw new Error('short read')
  }
  console.log(`files.write 100 MB: median ${median(up).toFixed(0)} MB/s; files.read 100 MB: median ${median(down).toFixed(0)} MB/s`)
} finally {
  await envd.stop()
}
