package server

import "net/http"

// E2B's GET /templates/{templateID}/tags and GET /templates/aliases/{alias} overlap
// ("/templates/aliases/tags" matches both) and neither is more specific, so ServeMux
// refuses to hold both. routeMux registers the tags route as the wider
// GET /templates/{templateID}/{sub}, which the alias route is more specific than: an
// alias lookup keeps winning for /templates/aliases/..., and the wider pattern answers
// only sub == "tags".
const (
	tagsRoute     = "GET /templates/{templateID}/tags"
	tagsWideRoute = "GET /templates/{templateID}/{sub}"
)

// routeMux is the ServeMux the generated routes are registered on.
type routeMux struct{ *http.ServeMux }

func (m routeMux) HandleFunc(pattern string, h func(http.ResponseWriter, *http.Request)) {
	if pattern != tagsRoute {
		m.ServeMux.HandleFunc(pattern, h)
		return
	}
	m.ServeMux.HandleFunc(tagsWideRoute, func(w http.ResponseWriter, r *http.Request) {
		if r.PathValue("sub") != "tags" {
			writeError(w, http.StatusNotFound, "route not found: %s %s", r.Method, r.URL.Path)
			return
		}
		h(w, r)
	})
}
