"""Where the store's rows live: a SQLite file (store.sqlite, the embedded default) or a PostgreSQL database
(store.postgres), chosen by what the cache is given: a path, or a `postgresql://` (or `postgres://`) URL.

Both backends offer the same few things, and the cache and the region store are written once over them:

    connection()    `with backend.connection() as conn:` this thread's connection (reads; `conn.execute(sql,
                    params)`, `conn.executemany(...)`, SQL in SQLite's spelling with `?` parameters, which the
                    PostgreSQL connection translates)
    transaction()   `with backend.transaction() as conn:` one short write, committed at the end of the block or
                    rolled back on an exception; nested in another on the same thread, it is part of that one
    dialect         "sqlite" or "postgresql", for the few statements spelt apart (store.regions)
    location        the path, or the URL with its password replaced by "***": what messages and logs show
    stored_bytes(), integrity_check(), close()

Every failure of the database comes out of `connection()` and `transaction()` as a typed `StoreError`
(pixeltriage.errors): StoreFullError, StoreLockedError, StoreReadOnlyError, StoreCorruptError or
StoreUnavailableError, naming the location; never the driver's own exception, never a password.
"""
from __future__ import annotations

import re
from urllib.parse import unquote

URL_SCHEMES = ("postgresql://", "postgres://")


def is_url(target) -> bool:
    """Whether a cache target is a PostgreSQL URL (else it is a path)."""
    return isinstance(target, str) and target.lower().startswith(URL_SCHEMES)


_USERINFO = re.compile(r"^(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)(?P<user>[^:@/?#]*):(?P<secret>[^@/?#]*)@")
_QUERY_SECRET = re.compile(r"(?P<name>[?&][^=&#]*password[^=&#]*)=(?P<secret>[^&#]*)", re.IGNORECASE)


def redact(url: str) -> str:
    """A URL as it may be shown: its password (in the user part or a `password=` parameter) replaced by ***."""
    url = _USERINFO.sub(lambda m: f"{m['scheme']}{m['user']}:***@", url, count=1)
    return _QUERY_SECRET.sub(lambda m: f"{m['name']}=***", url)


def secrets_of(url: str) -> list[str]:
    """The passwords a URL holds, as written and decoded (what `scrub` removes from a message)."""
    found = [m["secret"] for m in (_USERINFO.match(url),) if m] + [m["secret"] for m in _QUERY_SECRET.finditer(url)]
    return sorted({s for raw in found if raw for s in (raw, unquote(raw))}, key=len, reverse=True)


def scrub(message: str, url: str) -> str:
    """`message` with every password of `url` replaced by *** (a driver may quote what it was given)."""
    for secret in secrets_of(url):
        message = message.replace(secret, "***")
    return message
