"""The coordinator: who may read, write or delete which window, on SQLite or PostgreSQL.

Owns: the Coordinator (coordinator: opening a run, the one class callers use) and the
parts it is composed of, one per responsibility, sharing only the run (core: connection,
settings, tokens) — registration, fencing and liveness (roles), the producer's claims
(claims), the consumers' leases (leasing), removing window files (eviction) by the
retention rules (retention), named reads (reads); the window state machine (states), the
schema and its migrations (schema), the two database drivers (sqlitedb, postgresdb), the
tokens' value types (leases), who is lost and who holds a role (liveness), the database
seam (database), the heartbeat thread (heartbeat), what a wait waits for (waits), the
path locks of starts (pathlock), and `fanout status` / `sweep` / `detach` (status).

Sealed: only this package speaks SQL; everything else calls named Coordinator
methods, so both databases behave the same to callers.

May import: store, data, model, ops and the core.
"""
