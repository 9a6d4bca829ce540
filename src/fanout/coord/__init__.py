"""The coordinator: who may read, write or delete which window, on SQLite or PostgreSQL.

Owns: the Coordinator (coordinator: opening a run, the one class callers use) and the
parts it is composed of, one per responsibility, sharing only the run (core: connection,
settings, tokens) — registration, fencing and liveness (roles), the producer's claims
(claims), the consumers' leases (leasing), removing window files (eviction) by the
retention rules (retention); the read API for everything outside (reads); the window
state machine (states), the schema and its migrations (schema), the two database
drivers (sqlitedb, postgresdb), what it grants — registrations, claims and leases, with
their fencing tokens — as plain values (grants), who is lost and who holds a role
(liveness), the database seam and its clock (database), the heartbeat thread
(heartbeat), what a wait waits for (waits), what processes record for status
(records), the live source's chunk log (follow_log) and the path locks of starts
(pathlock). `fanout status` / `sweep` / `detach` are fanout.status's, a reader of
this package through reads and the Coordinator.

Sealed: only this package speaks SQL; everything else calls named Coordinator
methods, so both databases behave the same to callers.

May import: store, data, model, ops and the core.
"""
