// Package envd assembles the in-sandbox daemon: the Connect services (process, filesystem), the
// plain-HTTP endpoints (/health, /init, /envs, /metrics, /files) and access-token checks.
package envd

// Version is the E2B envd protocol level this daemon implements. The SDKs gate features on it
// (e2b-protocol.md 2.3); it is reported by /init and /health in the X-Envd-Version header and must
// be what the control plane returns as envdVersion.
const Version = "0.5.15"
