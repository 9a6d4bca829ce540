"""`fanout status`, `sweep` and `detach`: what a run is doing, for people and dashboards.

Owns: the commands and their flags (commands), the one snapshot every view shows, read
at one instant (snapshot), its versioned JSON schema (schema), the table (table), its
`--watch` redraw (watch), `--serve`'s HTTP server and Prometheus metrics (serve) and
its page with plots (page).

May import: coord, store, decode (its torch-free config: a served dir's layout) and the
core; of coord only the read API (fanout.coord.reads),
the Coordinator and the state names (fanout.coord.states), so that coord/ stays the
coordinator and its SQL stays inside it (pyproject.toml's import-linter contracts).
Never torch: `fanout status` is the command people run in a loop.
"""
