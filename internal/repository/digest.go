package repository

import (
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"hash"
	"io"
	"strings"
)

// Digest names a blob by its content: "sha256:" and 64 lowercase hex digits.
type Digest string

const digestPrefix = "sha256:"

// ParseDigest validates s. Only sha256 is accepted: it is what overlaybd and
// OCI use, and one algorithm keeps names canonical (no two names for a blob).
func ParseDigest(s string) (Digest, error) {
	d := Digest(s)
	return d, d.Validate()
}

// Validate reports whether d is a well-formed sha256 digest.
func (d Digest) Validate() error {
	h, ok := strings.CutPrefix(string(d), digestPrefix)
	if !ok || len(h) != sha256.Size*2 {
		return errorf(ErrInvalid, "digest %q: want sha256:<64 hex digits>", string(d))
	}
	for i := 0; i < len(h); i++ {
		c := h[i]
		if (c < '0' || c > '9') && (c < 'a' || c > 'f') {
			return errorf(ErrInvalid, "digest %q: want lowercase hex", string(d))
		}
	}
	return nil
}

// Hex is the digest without its algorithm prefix.
func (d Digest) Hex() string { return strings.TrimPrefix(string(d), digestPrefix) }

func (d Digest) String() string { return string(d) }

// DigestOf hashes b.
func DigestOf(b []byte) Digest {
	s := sha256.Sum256(b)
	return Digest(digestPrefix + hex.EncodeToString(s[:]))
}

// Verifier hashes what passes through it. Put streams blobs through one and
// compares at the end, so a blob is checked without a second read.
type Verifier struct {
	want Digest
	size int64 // expected size, or -1
	h    hash.Hash
	n    int64
}

// NewVerifier expects d and, when size ≥ 0, exactly size bytes.
func NewVerifier(d Digest, size int64) *Verifier {
	return &Verifier{want: d, size: size, h: sha256.New()}
}

// Write hashes p; it fails once more than the expected size has been seen.
func (v *Verifier) Write(p []byte) (int, error) {
	v.h.Write(p)
	v.n += int64(len(p))
	if v.size >= 0 && v.n > v.size {
		return 0, errorf(ErrDigestMismatch, "%s: more than the declared %d bytes", v.want, v.size)
	}
	return len(p), nil
}

// N is the number of bytes hashed.
func (v *Verifier) N() int64 { return v.n }

// Check compares what was hashed with the expectation.
func (v *Verifier) Check() error {
	if v.size >= 0 && v.n != v.size {
		return errorf(ErrDigestMismatch, "%s: got %d bytes, declared %d", v.want, v.n, v.size)
	}
	got := digestPrefix + hex.EncodeToString(v.h.Sum(nil))
	if got != string(v.want) {
		return errorf(ErrDigestMismatch, "want %s, got %s", v.want, got)
	}
	return nil
}

// VerifyingReader returns r's bytes and, at its end, the verifier's verdict:
// io.EOF when the content matches, an ErrDigestMismatch error when not. An
// uploader that stops on a read error therefore never completes a bad blob.
func VerifyingReader(r io.Reader, v *Verifier) io.Reader { return &verifyingReader{r: r, v: v} }

type verifyingReader struct {
	r    io.Reader
	v    *Verifier
	done error
}

func (vr *verifyingReader) Read(p []byte) (int, error) {
	if vr.done != nil {
		return 0, vr.done
	}
	n, err := vr.r.Read(p)
	if n > 0 {
		if _, werr := vr.v.Write(p[:n]); werr != nil {
			vr.done = werr
			return 0, werr
		}
		// With a declared size an uploader reads exactly that many bytes
		// and may never ask for EOF, so the verdict is due with the last
		// byte: withholding it fails the upload before it completes.
		if vr.v.size >= 0 && vr.v.n == vr.v.size && err == nil {
			if cerr := vr.endCheck(); cerr != nil {
				vr.done = cerr
				return 0, cerr
			}
			vr.done = io.EOF
			return n, nil
		}
	}
	if err == io.EOF {
		if cerr := vr.v.Check(); cerr != nil {
			vr.done = cerr
			return n, cerr
		}
		vr.done = io.EOF
	}
	return n, err
}

// endCheck runs at the declared size: the source must be at its end (an
// extra byte is a mismatch too) and the content must match.
func (vr *verifyingReader) endCheck() error {
	var one [1]byte
	for range 100 {
		m, err := vr.r.Read(one[:])
		if m > 0 {
			return errorf(ErrDigestMismatch, "%s: more than the declared %d bytes", vr.v.want, vr.v.size)
		}
		if err == io.EOF {
			break
		}
		if err != nil {
			return err
		}
	}
	return vr.v.Check()
}

// VerifyingReadCloser is VerifyingReader that also closes the source.
func VerifyingReadCloser(rc io.ReadCloser, d Digest, size int64) io.ReadCloser {
	return struct {
		io.Reader
		io.Closer
	}{VerifyingReader(rc, NewVerifier(d, size)), rc}
}

func errorf(sentinel error, format string, args ...any) error {
	return fmt.Errorf("%w: %s", sentinel, fmt.Sprintf(format, args...))
}
