"""A damaged chats database (not a database at all, or pages SQLite finds malformed): moved aside, never deleted,
and what can still be read of it copied into the new one that takes its place."""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path

# Tables in the order their rows may be copied (a message after its conversation, an attachment after its message)
TABLES = ("conversations", "messages", "attachments")
DAMAGE = ("not a database", "malformed", "corrupt")


def is_damage(exc: BaseException) -> bool:
    """Whether an error opening the database says its file is damaged (not that its folder cannot be written)."""
    return isinstance(exc, sqlite3.DatabaseError) and any(word in str(exc).lower() for word in DAMAGE)


def check(db: sqlite3.Connection) -> None:
    """Raise sqlite3.DatabaseError when SQLite's quick check finds the open database damaged."""
    found = [row[0] for row in db.execute("PRAGMA quick_check")]
    if found != ["ok"]:
        raise sqlite3.DatabaseError(f"database disk image is malformed ({'; '.join(found[:2])})")


def set_aside(path: Path) -> Path:
    """Move the database (and its WAL and shared-memory files) to a dated name beside it; return that name."""
    aside = path.with_name(f"{path.stem}.damaged-{time.strftime('%Y%m%d-%H%M%S')}{path.suffix}")
    for suffix in ("", "-wal", "-shm"):
        source = Path(str(path) + suffix)
        if source.exists():
            source.replace(Path(str(aside) + suffix))
    return aside


def salvage(damaged: Path, db: sqlite3.Connection) -> int:
    """Copy every row still readable from `damaged` into `db` (same tables; the columns both have), table by table,
    a table up to its first unreadable page. Returns the conversations copied."""
    try:
        old = sqlite3.connect(f"{damaged.resolve().as_uri()}?mode=ro", uri=True, timeout=5.0)
    except sqlite3.Error:
        return 0
    copied = {}
    try:
        for table in TABLES:
            copied[table] = 0
            try:
                have = [r[1] for r in old.execute(f"PRAGMA table_info({table})")]
                want = {r[1] for r in db.execute(f"PRAGMA table_info({table})")}
                columns = [c for c in have if c in want]
                if not columns:
                    continue
                names = ", ".join(columns)
                insert = f"INSERT OR IGNORE INTO {table} ({names}) VALUES ({', '.join('?' for _ in columns)})"
                for row in old.execute(f"SELECT {names} FROM {table}"):
                    try:
                        with db:
                            copied[table] += db.execute(insert, row).rowcount
                    except sqlite3.IntegrityError:  # its conversation or message was not readable
                        continue
            except sqlite3.DatabaseError:
                continue  # the rest of this table is past a damaged page
    finally:
        old.close()
    return copied.get("conversations", 0)
