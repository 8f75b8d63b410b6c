package build

import (
	"fmt"
	"strings"
)

// Word-level helpers of the Dockerfile parser: variable substitution and shell-like
// splitting and unquoting of instruction arguments.

// heredoc reports whether s holds a heredoc marker (<<EOF, <<-EOF, <<"EOF") outside a
// plain shell redirection of a here-string.
func heredoc(s string) bool {
	for i := strings.Index(s, "<<"); i >= 0; {
		rest := strings.TrimPrefix(s[i+2:], "-")
		if rest != "" && (rest[0] == '"' || rest[0] == '\'' || rest[0] >= 'A' && rest[0] <= 'Z' || rest[0] >= 'a' && rest[0] <= 'z') {
			return true
		}
		j := strings.Index(s[i+2:], "<<")
		if j < 0 {
			break
		}
		i += 2 + j
	}
	return false
}

// expand substitutes $VAR, ${VAR}, ${VAR:-default} and ${VAR:+alt} from ENV and ARG.
// A backslash escapes the next character.
func (p *dfParser) expand(s string) (string, error) {
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		c := s[i]
		switch {
		case c == '\\' && i+1 < len(s) && s[i+1] == '$':
			b.WriteByte('$')
			i++
		case c != '$' || i+1 == len(s):
			b.WriteByte(c)
		case s[i+1] == '{':
			end := strings.IndexByte(s[i:], '}')
			if end < 0 {
				return "", fmt.Errorf("unterminated ${ in %q", s)
			}
			expr := s[i+2 : i+end]
			name, mod, word := expr, "", ""
			if j := strings.Index(expr, ":"); j >= 0 {
				name, mod = expr[:j], expr[j:]
				if len(mod) < 2 || (mod[1] != '-' && mod[1] != '+') {
					return "", fmt.Errorf("unsupported substitution ${%s}", expr)
				}
				mod, word = mod[:2], mod[2:]
			}
			if !envKey.MatchString(name) {
				return "", fmt.Errorf("bad variable ${%s}", expr)
			}
			v, set := p.lookup(name)
			switch {
			case mod == ":-" && (!set || v == ""):
				v = word
			case mod == ":+":
				if set && v != "" {
					v = word
				} else {
					v = ""
				}
			}
			b.WriteString(v)
			i += end
		default:
			j := i + 1
			for j < len(s) && (s[j] == '_' || s[j] >= 'A' && s[j] <= 'Z' || s[j] >= 'a' && s[j] <= 'z' || j > i+1 && s[j] >= '0' && s[j] <= '9') {
				j++
			}
			if j == i+1 {
				b.WriteByte(c)
				continue
			}
			v, _ := p.lookup(s[i+1 : j])
			b.WriteString(v)
			i = j - 1
		}
	}
	return b.String(), nil
}

func (p *dfParser) lookup(name string) (string, bool) {
	if v, ok := p.env[name]; ok {
		return v, true
	}
	v, ok := p.args[name]
	return v, ok
}

type word struct{ raw string }

// shellWords splits on unquoted whitespace, keeping quotes in the words (values are
// unquoted after expansion).
func shellWords(s string) ([]word, error) {
	var (
		out   []word
		cur   strings.Builder
		quote byte
		in    bool
	)
	for i := 0; i < len(s); i++ {
		c := s[i]
		switch {
		case quote != 0:
			cur.WriteByte(c)
			if c == '\\' && quote == '"' && i+1 < len(s) {
				i++
				cur.WriteByte(s[i])
			} else if c == quote {
				quote = 0
			}
		case c == '"' || c == '\'':
			quote, in = c, true
			cur.WriteByte(c)
		case c == ' ' || c == '\t':
			if in {
				out = append(out, word{cur.String()})
				cur.Reset()
				in = false
			}
		default:
			if c == '\\' && i+1 < len(s) {
				cur.WriteByte(c)
				i++
				c = s[i]
			}
			cur.WriteByte(c)
			in = true
		}
	}
	if quote != 0 {
		return nil, fmt.Errorf("unterminated quote in %q", s)
	}
	if in {
		out = append(out, word{cur.String()})
	}
	return out, nil
}

// unquote removes shell quotes and backslash escapes from one word.
func unquote(s string) string {
	var b strings.Builder
	var quote byte
	for i := 0; i < len(s); i++ {
		c := s[i]
		switch {
		case quote == 0 && (c == '"' || c == '\''):
			quote = c
		case c == quote:
			quote = 0
		case c == '\\' && quote != '\'' && i+1 < len(s):
			i++
			b.WriteByte(s[i])
		default:
			b.WriteByte(c)
		}
	}
	return b.String()
}
