"""A PostgreSQL coordinator's URL: its schema, its password kept out of files and logs, its TCP settings.

    from fanout.coord.pgurl import parse_url, redact
    conninfo, schema, shown = parse_url("postgresql://fan:pw@db-host/fanout?schema=run1")
    redact(url)   # the URL without its password: safe to log and to write to the run dir

`?schema=NAME` (default `fanout`) is fanout's own parameter: one run per schema,
dropped from what libpq sees. Credentials: a password in the URL is used but never
written to the run dir; other processes read the URL from `coordinator.dbpath`, so
give them the password through PGPASSWORD or ~/.pgpass (libpq's own mechanisms).
Split from fanout.coord.postgresdb (the connection) so that both stay short; psycopg
is imported only where a function needs it.
"""

from __future__ import annotations

import re
from urllib.parse import parse_qsl, urlsplit, urlunsplit

from fanout.errors import ConfigError

SCHEMES = ("postgresql://", "postgres://")
DEFAULT_SCHEMA = "fanout"
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,50}")


def is_url(location: object) -> bool:
    return isinstance(location, str) and location.startswith(SCHEMES)


# libpq TCP settings every connection gets unless its URL sets them: a partition (a
# link cut with no RST, DESIGN "PostgreSQL as the lease engine") must end a call in
# about half a minute, not after TCP's ~15-minute retransmission give-up. An idle
# connection whose peer vanished is found by keepalives (10 s idle, then 3 probes 5 s
# apart); a request sent into the void by tcp_user_timeout (30 s unacknowledged).
TCP_DEFAULTS = {
    "keepalives": "1",
    "keepalives_idle": "10",
    "keepalives_interval": "5",
    "keepalives_count": "3",
    "tcp_user_timeout": "30000",
}


def tcp_settings(conninfo: str) -> dict[str, str]:
    """TCP_DEFAULTS less what `conninfo` (a URL or key=value string) sets itself: the
    keyword arguments that complete a connection's TCP settings."""
    from psycopg.conninfo import conninfo_to_dict

    given = conninfo_to_dict(conninfo)
    return {k: v for k, v in TCP_DEFAULTS.items() if k not in given}


def parse_url(url: str) -> tuple[str, str, str]:
    """(libpq URL without `schema`, schema name, URL for messages and files: no password)."""
    base, _, query = url.partition("?")
    names = [v for k, v in parse_qsl(query, keep_blank_values=True) if k == "schema"]
    schema = names[-1] if names else DEFAULT_SCHEMA
    if not _NAME.fullmatch(schema):
        raise ConfigError(
            f"{redact(url)}: schema {schema!r} must be a letter or _ then letters, digits, _ "
            "(at most 51 characters)"
        )
    # Drop `schema` (libpq refuses parameters it does not know), keep the rest verbatim.
    rest = [kv for kv in query.split("&") if kv and kv.partition("=")[0] != "schema"]
    conninfo = base + ("?" + "&".join(rest) if rest else "")
    return conninfo, schema, redact(url)


def redact(url: str) -> str:
    """The URL without its password, in the user part or as `?password=` (safe to log
    and to write to the run dir)."""
    base, sep, query = url.partition("?")
    kept = [kv for kv in query.split("&") if kv.partition("=")[0] != "password"]
    url = base + (sep + "&".join(kept) if kept else "")
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=f"{parts.username or ''}@{host}"))
