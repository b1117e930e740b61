"""Conversations in SQLite (WAL) under the user data dir.

A reply row is written when the turn starts and updated while it streams, so a crash or a kill loses
nothing that was already saved; rows left "streaming" by a crash are marked "interrupted" at the next
start. Each reply keeps its figures (TTFT, tok/s, tokens, compression), why it ended (its footer says so again
when the chat is reopened) and the model, quantization and knob settings it was made with, for export.
"""

from __future__ import annotations

import json
import sqlite3
import time
from dataclasses import dataclass, field
from pathlib import Path

from . import store_repair
from .format import pages as page_count
from .paths import database_path
from .protocol import AttachedDocument, HistoryTurn

# 2: each conversation's system prompt and settings; replies kept as versions. 3: why each reply ended
SCHEMA_VERSION = 3

SCHEMA = """
CREATE TABLE IF NOT EXISTS conversations (
    id INTEGER PRIMARY KEY,
    title TEXT NOT NULL,
    created REAL NOT NULL,
    updated REAL NOT NULL,
    system_prompt TEXT NOT NULL DEFAULT '',
    settings_json TEXT
);
CREATE TABLE IF NOT EXISTS messages (
    id INTEGER PRIMARY KEY,
    conversation_id INTEGER NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
    role TEXT NOT NULL CHECK (role IN ('user', 'assistant')),
    content TEXT NOT NULL DEFAULT '',
    model_content TEXT,
    status TEXT NOT NULL DEFAULT 'done',
    error TEXT,
    stats_json TEXT,
    settings_json TEXT,
    created REAL NOT NULL,
    updated REAL NOT NULL,
    reply_to INTEGER,
    active INTEGER NOT NULL DEFAULT 1,
    finish_reason TEXT
);
CREATE INDEX IF NOT EXISTS messages_by_conversation ON messages(conversation_id, id);
CREATE TABLE IF NOT EXISTS attachments (
    id INTEGER PRIMARY KEY,
    message_id INTEGER NOT NULL REFERENCES messages(id) ON DELETE CASCADE,
    name TEXT NOT NULL,
    path TEXT NOT NULL,
    kind TEXT NOT NULL,
    pages INTEGER,
    chars INTEGER NOT NULL,
    tokens INTEGER,
    text TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS attachments_by_message ON attachments(message_id);
"""

# Columns added after version 1, with their declarations (an older database gains them when it is opened)
ADDED_COLUMNS = {"conversations": (("system_prompt", "TEXT NOT NULL DEFAULT ''"), ("settings_json", "TEXT")),
                 # a reply's versions (regenerate keeps the earlier ones): the user message they answer, and
                 # whether this one is the version shown and read by the engine; why it ended (the engine's
                 # reason: "eos", "length", "context_full", "cancelled", …; none on a reply from before version 3)
                 "messages": (("reply_to", "INTEGER"), ("active", "INTEGER NOT NULL DEFAULT 1"),
                              ("finish_reason", "TEXT"))}

# Statuses of an assistant row.
STREAMING, DONE, STOPPED, ERROR, INTERRUPTED = "streaming", "done", "stopped", "error", "interrupted"
# What a reply's footer says about how it ended: the engine's reason where the user should know it, else its status
ENDINGS = {"length": "reached max new tokens", "context_full": "context full", "cancelled": "stopped"}
STATUS_ENDINGS = {STOPPED: "stopped", INTERRUPTED: "interrupted", ERROR: "ended by an error"}


@dataclass(frozen=True)
class Conversation:
    id: int
    title: str
    created: float
    updated: float


@dataclass(frozen=True)
class AttachmentInfo:
    id: int
    name: str
    kind: str
    pages: int | None
    chars: int
    tokens: int | None


@dataclass(frozen=True)
class Message:
    id: int
    conversation_id: int
    role: str
    content: str
    status: str
    created: float
    model_content: str | None = None
    error: str | None = None
    stats: dict | None = None
    settings: dict | None = None
    attachments: tuple[AttachmentInfo, ...] = field(default=())
    finish_reason: str | None = None  # the engine's reason the reply ended (None: streaming, or saved without it)


class StoreUnavailable(Exception):
    """The store cannot save (a read-only or full data folder): the message names the folder and what to do."""


class ConversationStore:
    """`read_only` is True when the data folder cannot be written (read-only, full, or missing and not
    creatable): existing chats open to read, and `problem` says why nothing new can be saved and what to do.
    A damaged database file is moved aside and replaced by a new one holding what could be read of it; `notice`
    says so (None otherwise)."""

    def __init__(self, path: Path | str | None = None):
        self.path = Path(path) if path is not None else database_path()
        self.read_only = False
        self.problem: str | None = None
        self.notice: str | None = None
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            try:
                self.db = self._open_writable()
            except sqlite3.DatabaseError as exc:
                if not store_repair.is_damage(exc):
                    raise
                self.db = self._replace_damaged(exc)
            self.recovered = self._recover_interrupted()
        except (OSError, sqlite3.Error) as exc:
            self.db = self._open_read_only(exc)
            self.recovered = 0
        # whether replies carry versions (schema 2; a database only read, from before it, has none): asked once
        self.has_versions = "active" in {r[1] for r in self.db.execute("PRAGMA table_info(messages)")}

    def _open_writable(self) -> sqlite3.Connection:
        db = sqlite3.connect(str(self.path), timeout=5.0)
        try:
            store_repair.check(db)
            db.row_factory = sqlite3.Row
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=NORMAL")  # WAL + NORMAL: a killed process loses no commit
            db.execute("PRAGMA foreign_keys=ON")
            if db.execute("PRAGMA user_version").fetchone()[0] != SCHEMA_VERSION or not db.execute(
                    "SELECT 1 FROM sqlite_master WHERE name='attachments'").fetchone():
                with db:
                    db.executescript(SCHEMA)
                    for table, columns in ADDED_COLUMNS.items():
                        have = {r[1] for r in db.execute(f"PRAGMA table_info({table})")}
                        for name, declaration in columns:
                            if name not in have:
                                db.execute(f"ALTER TABLE {table} ADD COLUMN {name} {declaration}")
                    db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
            # A write now, so that a folder that cannot take one is found at the start, not at the first send.
            with db:
                db.execute("CREATE TABLE IF NOT EXISTS write_check (x)")
                db.execute("DROP TABLE write_check")
        except BaseException:
            db.close()
            raise
        return db

    def _replace_damaged(self, cause: BaseException) -> sqlite3.Connection:
        aside = store_repair.set_aside(self.path)
        db = self._open_writable()
        kept = store_repair.salvage(aside, db)
        read = (f"{kept} chat(s) could be read from it and are back in the list" if kept else
                "nothing in it could be read")
        self.notice = (f"The file that holds your chats was damaged ({cause}). It was moved to {aside} and a new one "
                       f"started; {read}. Nothing was deleted: keep the moved file if a chat is missing.")
        return db

    def _open_read_only(self, cause: BaseException) -> sqlite3.Connection:
        folder = self.path.parent
        detail = getattr(cause, "strerror", None) or str(cause)
        full = "full" in str(cause).lower() or getattr(cause, "errno", None) == 28
        fix = ("Free some space on that disk" if full else
               f"Make the folder writable (for example: chmod u+w \"{folder}\")")
        self.read_only = True
        self.problem = (f"Your chats cannot be saved: the data folder {folder} is "
                        f"{'full' if full else 'not writable'} ({detail}). Existing chats open to read; new "
                        f"messages are not saved. {fix}, or start the app with DSV41_DATA_DIR set to a folder "
                        "you can write to, then restart the app.")
        db = None
        if self.path.exists():
            for query in ("mode=ro", "mode=ro&immutable=1"):  # immutable: a WAL database in a read-only folder
                try:
                    db = sqlite3.connect(f"{self.path.resolve().as_uri()}?{query}", uri=True, timeout=5.0)
                    db.execute("SELECT count(*) FROM conversations").fetchone()
                    break
                except sqlite3.Error:
                    if db is not None:
                        db.close()
                    db = None
        if db is None:  # nothing to read: an empty store in memory keeps the app usable
            db = sqlite3.connect(":memory:")
            db.executescript(SCHEMA)
        db.row_factory = sqlite3.Row
        return db

    def check_writable(self) -> None:
        if self.read_only:
            raise StoreUnavailable(self.problem)

    def close(self) -> None:
        self.db.close()

    def _recover_interrupted(self) -> int:
        with self.db:
            cur = self.db.execute("UPDATE messages SET status=? WHERE status=?", (INTERRUPTED, STREAMING))
        return cur.rowcount

    # ------------------------------------------------------------------ conversations
    def conversations(self, search: str = "") -> list[Conversation]:
        if search.strip():
            like = f"%{_escape_like(search.strip())}%"
            rows = self.db.execute(
                "SELECT * FROM conversations c WHERE c.title LIKE ? ESCAPE '\\' OR EXISTS "
                "(SELECT 1 FROM messages m WHERE m.conversation_id=c.id AND m.content LIKE ? ESCAPE '\\') "
                "ORDER BY updated DESC, id DESC", (like, like))
        else:
            rows = self.db.execute("SELECT * FROM conversations ORDER BY updated DESC, id DESC")
        return [Conversation(r["id"], r["title"], r["created"], r["updated"]) for r in rows]

    def conversation(self, conversation_id: int) -> Conversation | None:
        r = self.db.execute("SELECT * FROM conversations WHERE id=?", (conversation_id,)).fetchone()
        return Conversation(r["id"], r["title"], r["created"], r["updated"]) if r else None

    def create_conversation(self, title: str = "New chat") -> int:
        self.check_writable()
        now = time.time()
        with self.db:
            cur = self.db.execute("INSERT INTO conversations(title, created, updated) VALUES (?, ?, ?)",
                                  (title, now, now))
        return int(cur.lastrowid)

    def system_prompt(self, conversation_id: int) -> str:
        """The chat's system prompt ('' for none; a database from before version 2 has none)."""
        r = self.db.execute("SELECT * FROM conversations WHERE id=?", (conversation_id,)).fetchone()
        return (r["system_prompt"] or "") if r is not None and "system_prompt" in r.keys() else ""

    def set_system_prompt(self, conversation_id: int, text: str) -> None:
        self.check_writable()
        with self.db:
            self.db.execute("UPDATE conversations SET system_prompt=? WHERE id=?", (text, conversation_id))

    def chat_settings(self, conversation_id: int) -> dict | None:
        """The settings the chat was last used with ({"knobs": ..., "generation": ...}), None if never saved."""
        r = self.db.execute("SELECT * FROM conversations WHERE id=?", (conversation_id,)).fetchone()
        if r is None or "settings_json" not in r.keys():
            return None
        try:
            value = _loads(r["settings_json"])
        except ValueError:
            return None
        return value if isinstance(value, dict) else None

    def set_chat_settings(self, conversation_id: int, settings: dict) -> None:
        self.check_writable()
        with self.db:
            self.db.execute("UPDATE conversations SET settings_json=? WHERE id=?", (_dumps(settings), conversation_id))

    def rename(self, conversation_id: int, title: str) -> None:
        title = " ".join(title.split()) or "Untitled"
        with self.db:
            self.db.execute("UPDATE conversations SET title=? WHERE id=?", (title, conversation_id))

    def delete(self, conversation_id: int) -> None:
        with self.db:
            self.db.execute("DELETE FROM conversations WHERE id=?", (conversation_id,))

    def _touch(self, conversation_id: int, now: float) -> None:
        self.db.execute("UPDATE conversations SET updated=? WHERE id=?", (now, conversation_id))

    # ------------------------------------------------------------------ messages
    def messages(self, conversation_id: int) -> list[Message]:
        """The conversation as shown and read: each reply's active version."""
        where = " AND active=1" if self.has_versions else ""
        rows = self.db.execute(f"SELECT * FROM messages WHERE conversation_id=?{where} ORDER BY id",
                               (conversation_id,))
        out = []
        for r in rows.fetchall():
            out.append(Message(
                r["id"], r["conversation_id"], r["role"], r["content"], r["status"], r["created"],
                r["model_content"], r["error"], _loads(r["stats_json"]), _loads(r["settings_json"]),
                self._attachment_infos(r["id"]) if r["role"] == "user" else (),
                r["finish_reason"] if "finish_reason" in r.keys() else None))  # a database only read may lack it
        return out

    def message(self, message_id: int) -> Message | None:
        r = self.db.execute("SELECT conversation_id FROM messages WHERE id=?", (message_id,)).fetchone()
        if r is None:
            return None
        return next((m for m in self.messages(r["conversation_id"]) if m.id == message_id), None)

    def add_user_message(self, conversation_id: int, prompt: str, documents=()) -> int:
        now = time.time()
        with self.db:
            cur = self.db.execute(
                "INSERT INTO messages(conversation_id, role, content, status, created, updated) "
                "VALUES (?, 'user', ?, ?, ?, ?)", (conversation_id, prompt, DONE, now, now))
            message_id = int(cur.lastrowid)
            for doc, tokens in documents:
                self._attach(message_id, doc.name, doc.path, doc.kind, doc.pages, doc.chars, tokens, doc.text)
            self._touch(conversation_id, now)
        return message_id

    def add_turn(self, conversation_id: int, prompt: str, documents=(), settings: dict | None = None, *,
                 replace_from: int | None = None) -> tuple[int, int]:
        """The user's message and an empty streaming reply, in one transaction (all or nothing); with
        `replace_from`, that message and every later one go in the same transaction (edit and resend)."""
        self.check_writable()
        now = time.time()
        with self.db:
            if replace_from is not None:
                self.db.execute("DELETE FROM messages WHERE conversation_id=? AND id>=?",
                                (conversation_id, replace_from))
            cur = self.db.execute(
                "INSERT INTO messages(conversation_id, role, content, status, created, updated) "
                "VALUES (?, 'user', ?, ?, ?, ?)", (conversation_id, prompt, DONE, now, now))
            user_id = int(cur.lastrowid)
            for doc, tokens in documents:
                self._attach(user_id, doc.name, doc.path, doc.kind, doc.pages, doc.chars, tokens, doc.text)
            cur = self.db.execute(
                "INSERT INTO messages(conversation_id, role, content, status, settings_json, created, updated, "
                "reply_to) VALUES (?, 'assistant', '', ?, ?, ?, ?, ?)",
                (conversation_id, STREAMING, _dumps(settings), now, now, user_id))
            reply_id = int(cur.lastrowid)
            self._touch(conversation_id, now)
        return user_id, reply_id

    # ------------------------------------------------------------------ versions of a reply
    def _answered(self, reply_id: int) -> int | None:
        """The user message a reply answers: its reply_to, else (older rows) the user message before it."""
        r = self.db.execute("SELECT conversation_id, reply_to FROM messages WHERE id=? AND role='assistant'",
                            (reply_id,)).fetchone()
        if r is None:
            return None
        if r["reply_to"] is not None:
            return int(r["reply_to"])
        u = self.db.execute("SELECT max(id) FROM messages WHERE conversation_id=? AND role='user' AND id<?",
                            (r["conversation_id"], reply_id)).fetchone()
        return int(u[0]) if u and u[0] is not None else None

    def versions(self, reply_id: int) -> list[int]:
        """Every version of this reply (ids, oldest first): the replies to the same user message."""
        user_id = self._answered(reply_id)
        if user_id is None:
            return [reply_id]
        rows = self.db.execute(
            "SELECT id FROM messages WHERE role='assistant' AND (reply_to=? OR (reply_to IS NULL AND id=?)) "
            "ORDER BY id", (user_id, reply_id))
        return [int(r[0]) for r in rows] or [reply_id]

    def add_version(self, conversation_id: int, user_id: int, settings: dict | None = None) -> int:
        """A new (streaming) reply to `user_id`, shown instead of the ones before it, which stay as versions."""
        self.check_writable()
        now = time.time()
        with self.db:
            current = self.db.execute(
                "SELECT id FROM messages WHERE conversation_id=? AND role='assistant' AND active=1 AND id>? "
                "ORDER BY id LIMIT 1", (conversation_id, user_id)).fetchone()
            if current is not None and self._answered(int(current[0])) == user_id:
                self.db.execute("UPDATE messages SET reply_to=? WHERE id=?", (user_id, int(current[0])))
            self.db.execute("UPDATE messages SET active=0 WHERE role='assistant' AND reply_to=?", (user_id,))
            cur = self.db.execute(
                "INSERT INTO messages(conversation_id, role, content, status, settings_json, created, updated, "
                "reply_to, active) VALUES (?, 'assistant', '', ?, ?, ?, ?, ?, 1)",
                (conversation_id, STREAMING, _dumps(settings), now, now, user_id))
            self._touch(conversation_id, now)
        return int(cur.lastrowid)

    def select_version(self, reply_id: int) -> None:
        """Show (and have the engine read) this version of its reply."""
        user_id = self._answered(reply_id)
        with self.db:
            self.db.execute("UPDATE messages SET active=0 WHERE role='assistant' AND reply_to=?", (user_id,))
            self.db.execute("UPDATE messages SET active=1, reply_to=? WHERE id=?", (user_id, reply_id))

    def delete_message(self, message_id: int) -> None:
        """A user message goes with every version of its reply; a reply's version goes alone (the newest other
        version is shown instead)."""
        self.check_writable()
        r = self.db.execute("SELECT role, active FROM messages WHERE id=?", (message_id,)).fetchone()
        if r is None:
            return
        with self.db:
            if r["role"] == "user":
                replies = self._reply_ids(message_id)
                self.db.execute(f"DELETE FROM messages WHERE id IN ({','.join('?' * (len(replies) + 1))})",
                                (message_id, *replies))
                return
            others = [i for i in self.versions(message_id) if i != message_id]
            self.db.execute("DELETE FROM messages WHERE id=?", (message_id,))
            if r["active"] and others:
                self.db.execute("UPDATE messages SET active=1 WHERE id=?", (others[-1],))

    def _reply_ids(self, user_id: int) -> list[int]:
        first = self.db.execute(
            "SELECT id FROM messages WHERE role='assistant' AND id>? AND conversation_id=(SELECT conversation_id "
            "FROM messages WHERE id=?) AND active=1 ORDER BY id LIMIT 1", (user_id, user_id)).fetchone()
        ids = {int(r[0]) for r in self.db.execute("SELECT id FROM messages WHERE reply_to=?", (user_id,))}
        if first is not None and self._answered(int(first[0])) == user_id:
            ids.add(int(first[0]))
        return sorted(ids)

    def set_model_content(self, message_id: int, content: str) -> None:
        with self.db:
            self.db.execute("UPDATE messages SET model_content=? WHERE id=?", (content, message_id))

    def add_reply(self, conversation_id: int, settings: dict | None = None) -> int:
        now = time.time()
        with self.db:
            cur = self.db.execute(
                "INSERT INTO messages(conversation_id, role, content, status, settings_json, created, updated) "
                "VALUES (?, 'assistant', '', ?, ?, ?, ?)",
                (conversation_id, STREAMING, _dumps(settings), now, now))
            self._touch(conversation_id, now)
        return int(cur.lastrowid)

    def update_reply(self, message_id: int, text: str) -> None:
        with self.db:
            self.db.execute("UPDATE messages SET content=?, updated=? WHERE id=?", (text, time.time(), message_id))

    def finish_reply(self, message_id: int, text: str, status: str, *, stats: dict | None = None,
                     error: str | None = None, finish_reason: str | None = None) -> None:
        """The reply's final text, status and figures, and the engine's reason it ended (its footer says it)."""
        with self.db:
            self.db.execute(
                "UPDATE messages SET content=?, status=?, stats_json=?, error=?, finish_reason=?, updated=? "
                "WHERE id=?", (text, status, _dumps(stats), error, finish_reason, time.time(), message_id))

    def delete_messages_from(self, message_id: int) -> None:
        """Delete this message and every later one of its conversation (regenerate, edit-and-resend)."""
        r = self.db.execute("SELECT conversation_id FROM messages WHERE id=?", (message_id,)).fetchone()
        if r is None:
            return
        with self.db:
            self.db.execute("DELETE FROM messages WHERE conversation_id=? AND id>=?", (r["conversation_id"], message_id))

    # ------------------------------------------------------------------ attachments
    def _attach(self, message_id: int, name: str, path: str, kind: str, pages: int | None, chars: int,
                tokens: int | None, text: str) -> None:
        """A document's row under a message (inside the caller's transaction)."""
        self.db.execute("INSERT INTO attachments(message_id, name, path, kind, pages, chars, tokens, text) "
                        "VALUES (?, ?, ?, ?, ?, ?, ?, ?)", (message_id, name, path, kind, pages, chars, tokens, text))

    def _attachment_infos(self, message_id: int) -> tuple[AttachmentInfo, ...]:
        rows = self.db.execute("SELECT id, name, kind, pages, chars, tokens FROM attachments WHERE message_id=? "
                               "ORDER BY id", (message_id,))
        return tuple(AttachmentInfo(r["id"], r["name"], r["kind"], r["pages"], r["chars"], r["tokens"]) for r in rows)

    def attachments(self, message_id: int) -> tuple[AttachedDocument, ...]:
        rows = self.db.execute("SELECT * FROM attachments WHERE message_id=? ORDER BY id", (message_id,))
        return tuple(AttachedDocument(f"db-{r['id']}", r["name"], r["path"], r["kind"], r["text"], r["pages"],
                                      r["chars"]) for r in rows)

    # ------------------------------------------------------------------ what the engine sees again
    def history(self, conversation_id: int, before_message_id: int | None = None) -> tuple[HistoryTurn, ...]:
        """The exchanges the chat shows, as the model should read them, oldest first: each user message with its
        reply shown, or with none (reply "") where it has none or an empty one (its reply deleted, or stopped or cut
        off before it began): the model reads the question the chat shows."""
        turns = []
        pending_user: Message | None = None

        def close(reply: str) -> None:
            turns.append(HistoryTurn(pending_user.content, self.attachments(pending_user.id), reply,
                                     pending_user.model_content))

        for m in self.messages(conversation_id):
            if before_message_id is not None and m.id >= before_message_id:
                break
            if m.role == "user":
                if pending_user is not None:
                    close("")
                pending_user = m
            elif pending_user is not None:
                close(m.content)
                pending_user = None
        if pending_user is not None:
            close("")
        return tuple(turns)

    # ------------------------------------------------------------------ export
    def export_json(self, conversation_id: int) -> dict:
        conv = self.conversation(conversation_id)
        if conv is None:
            raise KeyError(conversation_id)
        messages = []
        for m in self.messages(conversation_id):
            item = {"role": m.role, "content": m.content, "created": _iso(m.created), "status": m.status}
            if m.attachments:  # with the text the model read: an export imports back whole (app/chat_import.py)
                texts = {document.key: document.text for document in self.attachments(m.id)}
                item["attachments"] = [{"name": a.name, "kind": a.kind, "pages": a.pages, "chars": a.chars,
                                        "tokens": a.tokens, "text": texts.get(f"db-{a.id}", "")}
                                       for a in m.attachments]
            if m.role == "assistant":
                if m.finish_reason:
                    item["finish_reason"] = m.finish_reason
                item["stats"] = m.stats
                item["settings"] = m.settings
                if m.error:
                    item["error"] = m.error
            messages.append(item)
        return {"format": "ds-v41-chat/conversation", "version": SCHEMA_VERSION, "title": conv.title,
                "created": _iso(conv.created), "updated": _iso(conv.updated),
                "system_prompt": self.system_prompt(conversation_id),
                "settings": self.chat_settings(conversation_id), "messages": messages}

    def import_chat(self, chat) -> int:
        """A chat read from an export (app.chat_import.ImportedChat) as a new conversation, in one transaction (all or
        nothing); its id. Each reply answers the user message just before it."""
        self.check_writable()
        now = time.time()
        with self.db:
            cur = self.db.execute(
                "INSERT INTO conversations(title, created, updated, system_prompt, settings_json) VALUES (?, ?, ?, ?, ?)",
                (chat.title, chat.created, now, chat.system_prompt, _dumps(chat.settings) if chat.settings else None))
            conversation_id = int(cur.lastrowid)
            last_user = None
            for m in chat.messages:
                cur = self.db.execute(
                    "INSERT INTO messages(conversation_id, role, content, status, error, stats_json, settings_json, "
                    "created, updated, reply_to, finish_reason) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (conversation_id, m.role, m.content, m.status, m.error, _dumps(m.stats), _dumps(m.settings),
                     m.created, m.created, last_user if m.role == "assistant" else None, m.finish_reason))
                message_id = int(cur.lastrowid)
                last_user = message_id if m.role == "user" else None
                for doc in m.documents:
                    self._attach(message_id, doc.name, "", doc.kind, doc.pages, len(doc.text), doc.tokens, doc.text)
        return conversation_id

    def export_markdown(self, conversation_id: int) -> str:
        data = self.export_json(conversation_id)
        lines = [f"# {data['title']}", "", f"*Exported from DS-V4.1 Chat — created {data['created']}*", ""]
        if data.get("system_prompt"):
            lines += ["## System prompt", "", data["system_prompt"], ""]
        for m in data["messages"]:
            if m["role"] == "user":
                lines += ["## You", ""]
                for a in m.get("attachments", []):
                    pages = f", {page_count(a['pages'])}" if a.get("pages") else ""
                    lines.append(f"> 📎 {a['name']} ({a['chars']:,} characters{pages})")
                if m.get("attachments"):
                    lines.append("")
                lines += [m["content"], ""]
            else:
                lines += ["## Assistant", "", m["content"] or "*(no text)*", ""]
                footer = reply_footer(m.get("stats"), m.get("status"), m.get("finish_reason"))
                if footer:
                    lines += [f"*{footer}*", ""]
                settings = m.get("settings") or {}
                if settings:
                    knobs = settings.get("knobs", {})
                    knob_text = ", ".join(f"{k}={v}" for k, v in knobs.items())
                    lines += [f"<sub>{settings.get('model', '?')} · weights {settings.get('weight_quant', '?')} · "
                              f"{settings.get('device', '?')}" + (f" · {knob_text}" if knob_text else "") + "</sub>",
                              ""]
                if m.get("error"):
                    lines += [f"> ⚠ {m['error']}", ""]
        return "\n".join(lines).rstrip() + "\n"


def reply_footer(stats: dict | None, status: str | None = None, finish_reason: str | None = None) -> str:
    """'TTFT 0.42 s · 21.3 tok/s · 128 tokens · KV ×0.50 · reached max new tokens' (the per-reply footer): the
    figures, then how the reply ended where the user should know it (the same when the reply ends and when the
    chat is opened again)."""
    parts = []
    if stats:
        parts.append(f"TTFT {stats.get('ttft_s', 0):.2f} s")
        parts.append(f"{stats.get('decode_tok_s', 0):.1f} tok/s")
        parts.append(f"{stats.get('decode_tokens', 0)} tokens")
        ratio = stats.get("compression_ratio")
        if ratio is not None and stats.get("kv_uncompressed_bytes", 1):  # 0: a server that reports no KV
            parts.append(f"KV ×{ratio:.2f}")
        if stats.get("recall_s"):
            parts.append(f"recalled in {stats['recall_s'] * 1000:.0f} ms")
        if stats.get("restored_context"):
            parts.append("saved cache restored")
        elif stats.get("rebuilt_context"):
            parts.append("conversation re-read")
    ending = ENDINGS.get(finish_reason or "") or STATUS_ENDINGS.get(status or "")
    if ending:
        parts.append(ending)
    return " · ".join(parts)


def _escape_like(text: str) -> str:
    return text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")


def _dumps(value) -> str | None:
    return json.dumps(value, ensure_ascii=False) if value is not None else None


def _loads(text: str | None):
    return json.loads(text) if text else None


def _iso(ts: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts))
