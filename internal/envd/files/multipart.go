package files

import (
	"mime"
	"strings"
)

// partNames returns the form field name and the file name of a multipart part from its
// Content-Disposition header. Unlike multipart.Part.FileName it keeps directories: E2B clients send
// the target path (absolute or relative to the user's home) as the file name.
func partNames(disposition string) (name, filename string) {
	_, params, err := mime.ParseMediaType(disposition)
	if err != nil {
		return lenientNames(disposition)
	}
	return params["name"], params["filename"]
}

// lenientNames handles dispositions mime.ParseMediaType rejects (e.g. unquoted or non-ASCII file
// names) by reading name= and filename= parameters directly.
func lenientNames(d string) (name, filename string) {
	for _, part := range splitParams(d) {
		k, v, ok := strings.Cut(strings.TrimSpace(part), "=")
		if !ok {
			continue
		}
		k = strings.ToLower(strings.TrimSpace(k))
		v = strings.TrimSpace(v)
		if len(v) >= 2 && v[0] == '"' && v[len(v)-1] == '"' {
			v = unquote(v[1 : len(v)-1])
		}
		switch k {
		case "name":
			name = v
		case "filename":
			filename = v
		}
	}
	return name, filename
}

// splitParams splits on ';' outside double quotes.
func splitParams(s string) []string {
	var out []string
	inQuote, esc, start := false, false, 0
	for i := 0; i < len(s); i++ {
		c := s[i]
		switch {
		case esc:
			esc = false
		case c == '\\' && inQuote:
			esc = true
		case c == '"':
			inQuote = !inQuote
		case c == ';' && !inQuote:
			out = append(out, s[start:i])
			start = i + 1
		}
	}
	return append(out, s[start:])
}

func unquote(s string) string {
	if !strings.ContainsRune(s, '\\') {
		return s
	}
	var b strings.Builder
	esc := false
	for i := 0; i < len(s); i++ {
		if !esc && s[i] == '\\' {
			esc = true
			continue
		}
		esc = false
		b.WriteByte(s[i])
	}
	return b.String()
}
