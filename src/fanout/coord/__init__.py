"""The coordinator: who may read, write or delete which window, on SQLite or PostgreSQL.

Owns: the Coordinator (coordinator: opening a run, the consumers' calls) and
everything behind it — what both sides share (base: connection, tokens, role
taking, reclaiming the dead), the producer's claims (claims), the named reads
(reads), the schema and its migrations (schema), the two database drivers
(sqlitedb, postgresdb), retention/eviction policy (retention), leases (leases),
who is lost and who holds a role (liveness), the heartbeat thread (heartbeat), and
`fanout status` / `fanout sweep` (status).

Sealed: only this package speaks SQL; everything else calls named Coordinator
methods, so both databases behave the same to callers.

May import: store, data, model, ops and the core.
"""
