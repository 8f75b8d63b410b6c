// The "internet" of test/e2e/egress.test.mjs, run inside the test's network namespace:
//   <web>:80   HTTP, answers "host=<Host> auth=<Authorization>"
//   <web>:443  TLS, records the SNI of each ClientHello (the handshake then fails: no cert);
//              with a 6th argument (a directory holding srv.key and srv.pem) HTTPS instead,
//              answering "https host=<Host> auth=<Authorization>"
//   <web>:81   GET /snis, /socks: what the TLS and SOCKS5 servers saw (JSON)
//   <dns>:53   DNS (UDP), A records from argv: name=ip,...
//   <socks>:1080 SOCKS5, username/password "su"/"sp", records CONNECT targets
// and the same HTTP server on <private>:80. Prints "ready" once all listen.
'use strict'
const net = require('net')
const http = require('http')
const tls = require('tls')
const https = require('https')
const fs = require('fs')
const path = require('path')
const dgram = require('dgram')

const [web, dns, socks, priv, recordsArg, certDir] = process.argv.slice(2)
const records = Object.fromEntries(recordsArg.split(',').map((kv) => kv.split('=')))
const snis = []
const targets = []
let pending = 0
const listening = () => { if (--pending === 0) console.log('ready') }

const echo = (req, res) => res.end(`host=${req.headers.host} auth=${req.headers.authorization || ''}\n`)
for (const addr of [web, priv]) { pending++; http.createServer(echo).listen(80, addr, listening) }

pending++
if (certDir) {
  https.createServer({
    key: fs.readFileSync(path.join(certDir, 'srv.key')),
    cert: fs.readFileSync(path.join(certDir, 'srv.pem')),
  }, (req, res) => res.end(`https host=${req.headers.host} auth=${req.headers.authorization || ''}\n`))
    .on('tlsClientError', () => {}).listen(443, web, listening)
} else {
  tls.createServer({
    SNICallback: (name, cb) => { snis.push(name); cb(new Error('no certificate')) },
  }).on('tlsClientError', () => {}).listen(443, web, listening)
}

pending++
http.createServer((req, res) => res.end(JSON.stringify(req.url === '/snis' ? snis : targets))).listen(81, web, listening)

pending++
const udp = dgram.createSocket('udp4')
udp.on('message', (q, rinfo) => {
  let off = 12
  const labels = []
  while (q[off] !== 0) { labels.push(q.subarray(off + 1, off + 1 + q[off]).toString()); off += q[off] + 1 }
  const qEnd = off + 5
  const name = labels.join('.').toLowerCase()
  const qtype = q.readUInt16BE(off + 1)
  const ip = records[name]
  const head = Buffer.alloc(12)
  q.copy(head, 0, 0, 2)
  head.writeUInt16BE(ip ? 0x8180 : 0x8183, 2)
  head.writeUInt16BE(1, 4)
  const answer = ip && qtype === 1
  head.writeUInt16BE(answer ? 1 : 0, 6)
  const parts = [head, q.subarray(12, qEnd)]
  if (answer) {
    const a = Buffer.alloc(16)
    a.writeUInt16BE(0xc00c, 0); a.writeUInt16BE(1, 2); a.writeUInt16BE(1, 4); a.writeUInt32BE(1, 6); a.writeUInt16BE(4, 10)
    ip.split('.').forEach((b, i) => { a[12 + i] = Number(b) })
    parts.push(a)
  }
  udp.send(Buffer.concat(parts), rinfo.port, rinfo.address)
})
udp.bind(53, dns, listening)

pending++
// Half-open: a client that has sent everything (a FIN) still gets the answer.
net.createServer({ allowHalfOpen: true }, (c) => {
  let buf = Buffer.alloc(0)
  let stage = 'greet'
  const onData = (d) => {
    buf = Buffer.concat([buf, d])
    if (stage === 'greet' && buf.length >= 2 && buf.length >= 2 + buf[1]) {
      const methods = buf.subarray(2, 2 + buf[1]); buf = buf.subarray(2 + buf[1])
      if (!methods.includes(2)) { c.end(Buffer.from([5, 0xff])); return }
      c.write(Buffer.from([5, 2])); stage = 'auth'
    }
    if (stage === 'auth' && buf.length >= 2) {
      const ul = buf[1]; if (buf.length < 3 + ul) return
      const pl = buf[2 + ul]; if (buf.length < 3 + ul + pl) return
      const user = buf.subarray(2, 2 + ul).toString(); const pass = buf.subarray(3 + ul, 3 + ul + pl).toString()
      buf = buf.subarray(3 + ul + pl)
      if (user !== 'su' || pass !== 'sp') { c.end(Buffer.from([1, 1])); return }
      c.write(Buffer.from([1, 0])); stage = 'connect'
    }
    if (stage === 'connect' && buf.length >= 10 && buf[3] === 1) {
      const host = [...buf.subarray(4, 8)].join('.'); const port = buf.readUInt16BE(8)
      buf = buf.subarray(10)
      targets.push(`${host}:${port}`)
      c.pause() // what the client sends before the upstream is connected waits
      c.removeListener('data', onData)
      const up = net.connect({ port, host, allowHalfOpen: true }, () => {
        c.write(Buffer.from([5, 0, 0, 1, 0, 0, 0, 0, 0, 0]))
        if (buf.length) up.write(buf)
        c.pipe(up); up.pipe(c)
      })
      up.on('error', () => c.destroy()); c.on('error', () => up.destroy())
      stage = 'done'
    }
  }
  c.on('data', onData)
  c.on('error', () => {})
}).listen(1080, socks, listening)
