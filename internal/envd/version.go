// Package envd assembles the in-sandbox daemon: the Connect services (process, filesystem), the
// plain-HTTP endpoints (/health, /init, /envs, /metrics, /files) and access-token checks.
package envd

// Version is the E2B envd protocol level this daemon implements. The SDKs gate features on it
// (e2b-protocol.md 2.3): 0.6.2 file metadata (X-Metadata-* → user xattrs, EntryInfo.metadata),
// 0.6.3 watchDir includeEntry, 0.6.4 allowNetworkMounts (watching is never refused) are all
// implemented. It is reported by /init and /health in the X-Envd-Version header and is what the
// control plane must return as envdVersion.
const Version = "0.6.4"
