"""A chat exported as JSON (Export ▸ JSON) read back: Chat ▸ Import a chat… makes it a new chat, with its messages,
the documents' text the model read (exports carry it), each reply's figures, settings and ending, the system prompt
and the chat's knobs. The file is checked whole before anything is written (the store then writes it in one
transaction): a file that is not such an export, or is damaged, says what it is and changes nothing. Its text is
data like any other message's: only the chat template's own markers are special.

An export made before exports carried the documents' text names its documents without their text: they are left
out, and the import says so (the chat's later questions cannot see them)."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

FORMAT = "ds-v41-chat/conversation"
MAX_BYTES = 256 * 1024 * 1024  # a chat with many long documents; past it the file is refused
_STATUSES = ("done", "stopped", "error", "interrupted")  # a reply exported while streaming comes back interrupted
_KINDS = ("text", "markdown", "source", "pdf", "docx", "web")


class ChatImportError(ValueError):
    """Why a file cannot be imported, in words for the user."""


@dataclass
class ImportedDocument:
    name: str
    kind: str
    text: str
    pages: int | None
    tokens: int | None


@dataclass
class ImportedMessage:
    role: str
    content: str
    created: float
    status: str = "done"
    documents: list[ImportedDocument] = field(default_factory=list)
    stats: dict | None = None
    settings: dict | None = None
    finish_reason: str | None = None
    error: str | None = None


@dataclass
class ImportedChat:
    title: str
    created: float
    system_prompt: str
    settings: dict | None
    messages: list[ImportedMessage]
    notes: list[str] = field(default_factory=list)  # what was left out, for the user


def read_export(path: str | Path) -> ImportedChat:
    """The chat in the JSON file at `path` (ChatImportError says why not)."""
    name = Path(path).name
    try:
        size = Path(path).stat().st_size
        if size > MAX_BYTES:
            raise ChatImportError(f'"{name}" is {size / 2**20:,.0f} MB; a chat export is at most '
                                  f"{MAX_BYTES // 2**20} MB.")
        raw = Path(path).read_bytes()
    except OSError as exc:
        raise ChatImportError(f'"{name}" could not be read: {exc.strerror or exc}.') from None
    try:
        data = json.loads(raw.decode("utf-8-sig"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise ChatImportError(f'"{name}" is not a chat exported by DS-V4.1 Chat (Export ▸ JSON): it is not JSON '
                              f"({exc}).") from None
    return parse_export(data, name)


def parse_export(data, name: str = "the file") -> ImportedChat:
    """An export's JSON value checked and turned into an ImportedChat (ChatImportError names what is wrong)."""
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ChatImportError(f'"{name}" is not a chat exported by DS-V4.1 Chat (Export ▸ JSON): it has no '
                              f'"format": "{FORMAT}".')
    messages = data.get("messages")
    if not isinstance(messages, list):
        raise ChatImportError(f'"{name}" is damaged: its "messages" is not a list.')
    now = time.time()
    chat = ImportedChat(title=_text(data.get("title"))[:200].strip() or "Imported chat",
                        created=_when(data.get("created"), now), system_prompt=_text(data.get("system_prompt")),
                        settings=data.get("settings") if isinstance(data.get("settings"), dict) else None,
                        messages=[])
    left_out = 0
    for index, item in enumerate(messages, 1):
        if not isinstance(item, dict) or item.get("role") not in ("user", "assistant") \
                or not isinstance(item.get("content"), str):
            raise ChatImportError(f'"{name}" is damaged: message {index} has no role ("user" or "assistant") or '
                                  "no text.")
        message = ImportedMessage(item["role"], item["content"], _when(item.get("created"), now))
        if message.role == "user":
            for doc in item.get("attachments") or []:
                if not isinstance(doc, dict) or not isinstance(doc.get("text"), str):
                    left_out += 1
                    continue
                pages, tokens = doc.get("pages"), doc.get("tokens")
                message.documents.append(ImportedDocument(
                    _text(doc.get("name")) or "document", doc.get("kind") if doc.get("kind") in _KINDS else "text",
                    doc["text"], pages if _count(pages) else None, tokens if _count(tokens) else None))
        else:
            status = item.get("status")
            message.status = status if status in _STATUSES else ("interrupted" if status == "streaming" else "done")
            message.stats = item.get("stats") if isinstance(item.get("stats"), dict) else None
            message.settings = item.get("settings") if isinstance(item.get("settings"), dict) else None
            message.finish_reason = item.get("finish_reason") if isinstance(item.get("finish_reason"), str) else None
            message.error = item.get("error") if isinstance(item.get("error"), str) else None
        chat.messages.append(message)
    if left_out:
        chat.notes.append(f"{left_out} document{'s' if left_out != 1 else ''} of this export came without "
                          "{} text (an export made before exports carried it): left out, so later questions cannot "
                          "see {}.".format("its" if left_out == 1 else "their", "it" if left_out == 1 else "them"))
    return chat


def _text(value) -> str:
    return value if isinstance(value, str) else ""


def _count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _when(value, default: float) -> float:
    """An export's local time ('2026-12-06 23:51:02') as a timestamp; `default` when it is missing or damaged."""
    try:
        return datetime.strptime(value, "%Y-%m-%d %H:%M:%S").timestamp()
    except (TypeError, ValueError, OverflowError, OSError):
        return default
