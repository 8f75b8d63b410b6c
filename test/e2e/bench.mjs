// SDK benchmark (not a test): create → first command completed through the pinned E2B JS SDK,
// against a running node named by E2B_API_URL / E2B_SANDBOX_URL / E2B_API_KEY (as a user sets
// them for single-server mode).
//
//   node test/e2e/bench.mjs [--n 50] [--concurrency 1] [--warmup 2] [--template base]
//
// Per sandbox: Sandbox.create(template) then sbx.commands.run('true') until it returns, then
// sbx.kill() (not timed). Prints one JSON object on stdout: every sample (so `aenv bench create
// --sdk-script` computes percentiles the same way as for its REST path) and this script's own
// nearest-rank percentiles in milliseconds. Progress goes to stderr.
//
// Each sample also has clientMs, the time the SDK spent in its own code, with no request
// outstanding (read from undici's diagnostics channels): from Sandbox.create() to the create
// request sent, from the create's answer to the command's request sent, and from the end of
// the command's stream to commands.run() returning. clientCpuMs is this process's CPU per
// measured sandbox (kill included). Neither is counted in the node's CPU figures.
import dc from 'node:diagnostics_channel'
import { parseArgs } from 'node:util'
import { Sandbox } from 'e2b'

const { values: args } = parseArgs({
  options: {
    n: { type: 'string', default: '50' },
    concurrency: { type: 'string', default: '1' },
    warmup: { type: 'string', default: '2' },
    template: { type: 'string', default: 'base' },
    timeout: { type: 'string', default: '120' }, // sandbox TTL (s): leftovers of a crash expire
  },
})
const n = Number(args.n)
const concurrency = Number(args.concurrency)
const warmup = Number(args.warmup)
const timeoutMs = Number(args.timeout) * 1000
for (const [k, v] of [['n', n], ['concurrency', concurrency]]) {
  if (!Number.isInteger(v) || v < 1) throw new Error(`--${k} must be a positive integer`)
}
for (const k of ['E2B_API_URL', 'E2B_API_KEY']) {
  if (!process.env[k]) throw new Error(`${k} is not set: point it at a running aenv serve`)
}

// HTTP milestones of the sandbox being measured, by request: the create's (POST
// /v2/sandboxes) and the command's (process.Process/Start). With concurrency > 1 requests of
// several sandboxes interleave, so the split is taken in sequential runs only.
let marks = null
const requestKind = (request) =>
  request.path.startsWith('/v2/sandboxes') && request.method === 'POST' ? 'create'
    : request.path.endsWith('/process.Process/Start') ? 'start' : ''
const mark = (name) => ({ request }) => {
  const kind = marks && requestKind(request)
  if (kind) marks[kind + name] ??= performance.now()
}
if (concurrency === 1) {
  dc.subscribe('undici:request:bodySent', mark('Sent'))
  dc.subscribe('undici:request:headers', mark('Answered'))
  dc.subscribe('undici:request:trailers', mark('Done'))
}

// clientTime is the part of t0..t2 with no request outstanding (see the header).
function clientTime(m, t0, t2) {
  if (!m?.createSent || !m.createAnswered || !m.startSent || !m.startDone) return undefined
  return (m.createSent - t0) + (m.startSent - m.createAnswered) + Math.max(0, t2 - m.startDone)
}

// one measures one sandbox; a failure is a sample with its error, not an exception.
async function one() {
  const t0 = performance.now()
  let sbx
  marks = concurrency === 1 ? {} : null
  try {
    sbx = await Sandbox.create(args.template, { timeoutMs })
    const t1 = performance.now()
    const r = await sbx.commands.run('true')
    const t2 = performance.now()
    if (r.exitCode !== 0) throw new Error(`'true' exited with ${r.exitCode}: ${r.stderr}`)
    return { createMs: t1 - t0, commandMs: t2 - t1, clientMs: clientTime(marks, t0, t2) }
  } catch (err) {
    return { createMs: 0, commandMs: 0, error: String(err?.message ?? err) }
  } finally {
    marks = null
    if (sbx) await sbx.kill().catch((err) => console.error(`kill ${sbx.sandboxId}: ${err}`))
  }
}

// Warm-up failures are reported but tolerated (up to three tries per warm-up sandbox): they
// are not measured, and one bad sandbox must not void a whole run.
for (let ok = 0, tries = 0; ok < warmup; tries++) {
  if (tries >= 3 * warmup) throw new Error(`warm-up: ${tries} sandboxes failed`)
  const s = await one()
  if (s.error) console.error(`warm-up sandbox failed: ${s.error}`)
  else ok++
}

const samples = new Array(n)
let next = 0
let done = 0
const start = performance.now()
const cpu0 = process.cpuUsage()
await Promise.all(Array.from({ length: Math.min(concurrency, n) }, async () => {
  for (let i = next++; i < n; i = next++) {
    samples[i] = await one()
    done++
    if (process.stderr.isTTY) process.stderr.write(`\rsdk c=${concurrency}: ${done}/${n}`)
  }
}))
const wallMs = performance.now() - start
const cpu = process.cpuUsage(cpu0)
if (process.stderr.isTTY) process.stderr.write('\n')

// Nearest-rank percentiles, as internal/bench computes them.
function summary(xs) {
  const s = [...xs].sort((a, b) => a - b)
  if (s.length === 0) return { n: 0 }
  const pct = (p) => s[Math.min(s.length, Math.max(1, Math.ceil((p / 100) * s.length))) - 1]
  const r = (x) => Math.round(x * 100) / 100
  return {
    n: s.length, min: r(s[0]), p50: r(pct(50)), p95: r(pct(95)), p99: r(pct(99)),
    max: r(s[s.length - 1]), mean: r(s.reduce((a, b) => a + b, 0) / s.length),
  }
}
const ok = samples.filter((s) => !s.error)
console.log(JSON.stringify({
  mode: 'sdk',
  concurrency,
  n,
  failures: n - ok.length,
  wallMs,
  clientCpuMs: (cpu.user + cpu.system) / 1000 / n,
  totalMs: summary(ok.map((s) => s.createMs + s.commandMs)),
  createMs: summary(ok.map((s) => s.createMs)),
  commandMs: summary(ok.map((s) => s.commandMs)),
  clientMs: summary(ok.filter((s) => s.clientMs !== undefined).map((s) => s.clientMs)),
  samples,
}))
