package egressproxy

import (
	"crypto"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"errors"
	"fmt"
	"math/big"
	"os"
	"path/filepath"
	"sync"
	"time"

	"github.com/aenv-dev/aenv/internal/atomicfile"
)

// CA is the node's egress CA: the proxy terminates the TLS of connections to domains that
// have network.rules with leaf certificates it signs, and sandboxes trust it (the
// orchestrator installs CertPEM into them). The key never leaves the node's data
// directory (mode 0600); a CA made on one node is useless on another.
type CA struct {
	cert    *x509.Certificate
	key     crypto.Signer
	certPEM []byte
	now     func() time.Time

	mu     sync.Mutex
	leaves map[string]*tls.Certificate
}

const (
	caFile    = "ca.crt"
	caKeyFile = "ca.key"
	// caValidity is long: sandboxes keep the CA they were given for their whole life.
	caValidity = 10 * 365 * 24 * time.Hour
	// leafValidity is short, a leaf is renewed once less than leafRenew remains.
	leafValidity = 7 * 24 * time.Hour
	leafRenew    = 24 * time.Hour
	// maxLeaves bounds the cache; when full it is emptied (leaves are cheap to mint again).
	maxLeaves = 4096
)

// LoadOrCreateCA loads the CA kept in dir (ca.crt, ca.key) or makes one there.
func LoadOrCreateCA(dir string) (*CA, error) {
	certPEM, err := os.ReadFile(filepath.Join(dir, caFile))
	if errors.Is(err, os.ErrNotExist) {
		return createCA(dir)
	}
	if err != nil {
		return nil, fmt.Errorf("egress CA: %w", err)
	}
	keyPEM, err := os.ReadFile(filepath.Join(dir, caKeyFile))
	if err != nil {
		return nil, fmt.Errorf("egress CA key: %w", err)
	}
	pair, err := tls.X509KeyPair(certPEM, keyPEM)
	if err != nil {
		return nil, fmt.Errorf("egress CA in %s: %w", dir, err)
	}
	cert, err := x509.ParseCertificate(pair.Certificate[0])
	if err != nil {
		return nil, fmt.Errorf("egress CA in %s: %w", dir, err)
	}
	signer, ok := pair.PrivateKey.(crypto.Signer)
	if !ok || !cert.IsCA {
		return nil, fmt.Errorf("egress CA in %s: not a CA certificate with a signing key", dir)
	}
	return newCA(cert, signer, certPEM), nil
}

func createCA(dir string) (*CA, error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, fmt.Errorf("egress CA key: %w", err)
	}
	now := time.Now()
	tmpl := &x509.Certificate{
		SerialNumber:          serial(),
		Subject:               pkix.Name{CommonName: "aenv egress CA " + now.UTC().Format("2006-01-02T15:04:05Z")},
		NotBefore:             now.Add(-time.Hour),
		NotAfter:              now.Add(caValidity),
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageCRLSign,
		BasicConstraintsValid: true,
		IsCA:                  true,
		MaxPathLenZero:        true,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		return nil, fmt.Errorf("egress CA: %w", err)
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		return nil, fmt.Errorf("egress CA: %w", err)
	}
	keyDER, err := x509.MarshalPKCS8PrivateKey(key)
	if err != nil {
		return nil, fmt.Errorf("egress CA key: %w", err)
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, fmt.Errorf("egress CA: %w", err)
	}
	certPEM := pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der})
	// The key first: a crash in between leaves no certificate, so the next start makes
	// a new pair rather than finding a certificate without its key.
	if err := atomicfile.WriteFile(filepath.Join(dir, caKeyFile), pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: keyDER}), 0o600); err != nil {
		return nil, fmt.Errorf("egress CA key: %w", err)
	}
	if err := atomicfile.WriteFile(filepath.Join(dir, caFile), certPEM, 0o644); err != nil {
		return nil, fmt.Errorf("egress CA: %w", err)
	}
	return newCA(cert, key, certPEM), nil
}

func newCA(cert *x509.Certificate, key crypto.Signer, certPEM []byte) *CA {
	return &CA{cert: cert, key: key, certPEM: certPEM, now: time.Now, leaves: map[string]*tls.Certificate{}}
}

// CertPEM is the CA certificate, PEM encoded: what sandboxes are given to trust.
func (ca *CA) CertPEM() []byte { return ca.certPEM }

// Leaf returns a certificate for host signed by the CA, minted on first use and cached
// until it nears its end.
func (ca *CA) Leaf(host string) (*tls.Certificate, error) {
	now := ca.now()
	ca.mu.Lock()
	defer ca.mu.Unlock()
	if c, ok := ca.leaves[host]; ok && c.Leaf.NotAfter.Sub(now) > leafRenew {
		return c, nil
	}
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, fmt.Errorf("egress leaf key: %w", err)
	}
	tmpl := &x509.Certificate{
		SerialNumber: serial(),
		Subject:      pkix.Name{CommonName: host},
		DNSNames:     []string{host},
		NotBefore:    now.Add(-time.Hour),
		NotAfter:     now.Add(leafValidity),
		KeyUsage:     x509.KeyUsageDigitalSignature,
		ExtKeyUsage:  []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
	}
	if tmpl.NotAfter.After(ca.cert.NotAfter) {
		tmpl.NotAfter = ca.cert.NotAfter
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca.cert, &key.PublicKey, ca.key)
	if err != nil {
		return nil, fmt.Errorf("egress leaf for %s: %w", host, err)
	}
	leaf, err := x509.ParseCertificate(der)
	if err != nil {
		return nil, fmt.Errorf("egress leaf for %s: %w", host, err)
	}
	c := &tls.Certificate{Certificate: [][]byte{der, ca.cert.Raw}, PrivateKey: key, Leaf: leaf}
	if len(ca.leaves) >= maxLeaves {
		clear(ca.leaves)
	}
	ca.leaves[host] = c
	return c, nil
}

func serial() *big.Int {
	n, err := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 127))
	if err != nil {
		panic(err) // crypto/rand does not fail on Linux
	}
	return n
}
