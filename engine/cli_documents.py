"""The terminal's documents: `--document` and `/doc` paths read as the app reads what is dropped on it, a folder
giving the documents inside it (documents/folder.py), and a /doc line parsed as a terminal pastes a dragged file."""

from __future__ import annotations

import os
import shlex
import sys

from .errors import EngineError


def expand(paths: list[str]) -> list[str]:
    """Each path as given, a folder replaced by the documents inside it (what it left out said on stderr; a folder
    without any is a DocumentError)."""
    from .documents.folder import documents_or_refuse

    files = []
    for path in paths:
        if not os.path.isdir(os.path.expanduser(path)):
            files.append(path)
            continue
        found = documents_or_refuse(os.path.expanduser(path))
        files += found.files
        if found.summary():
            print(f"({found.summary()})", file=sys.stderr)
    return files


def documents(paths: list[str]) -> list:
    """The --document files (or folders) read before the model loads (a bad one fails at once, without the wait)."""
    from .documents import load_document

    return [load_document(path) for path in expand(paths)]


def attach(path: str, pending: list, model=None) -> None:
    """Read a /doc or --document file now (a folder: each document in it): its error (or its size) is said at once,
    and only good files wait. With the model, a file too large for the context is said at once too (it stays
    attached until /doc clear)."""
    from .documents import load_document

    try:
        files = expand([path])
    except EngineError as exc:
        print(f"error: {exc} (not attached)", file=sys.stderr)
        return
    for one in files:
        try:
            doc = load_document(one)
        except EngineError as exc:
            print(f"error: {exc} (not attached)", file=sys.stderr)
            continue
        pending.append(doc)
        notes = "".join(f"; {note}" for note in doc.notes)
        print(f"(attached {doc.name}, {doc.chars:,} characters, to the next message{notes})", file=sys.stderr)
        if model is not None:
            tokens = model.document_tokens(doc)
            if tokens >= model.context_limit:
                print(f"warning: {doc.name} is {tokens:,} tokens and the context holds {model.context_limit:,}: no "
                      f"message can carry it. /doc clear drops it; a larger context needs --max-seq-len (up to the "
                      f"model's {model.max_positions:,} positions) when the chat starts.", file=sys.stderr)


def typed_paths(text: str) -> list[str]:
    """The file(s) a /doc line names as a terminal gives them: a path as typed (~ expanded; spaces and all), or the
    quoted or backslash-escaped paths a file dragged into the terminal pastes (several, for several files)."""
    if os.path.exists(os.path.expanduser(text)):
        return [text]
    try:
        words = shlex.split(text)
    except ValueError:  # an unbalanced quote: the text as it is (its error names it)
        return [text]
    if len(words) > 1 and any(os.path.exists(os.path.expanduser(w)) for w in words):
        return words  # several files: each is attached, or refused with its own error
    return [words[0]] if len(words) == 1 else [text]


def names(docs: list) -> str:
    return ", ".join(doc.name for doc in docs)


def heat(session, sent: list) -> str:
    """/heat: for each document the chat has read, what its cache holds hot now and where (engine.heat)."""
    if not sent:
        return "(no document has been sent in this chat yet)"
    lines = []
    for doc in sent:
        found = session.document_heat(doc.text)
        if found is None:
            lines.append(f"{doc.name}: not in the cache now (the conversation was reset or read again without it)")
        else:
            lines.append(f"{doc.name}: {found.summary()}\n  start |{found.strip(len(doc.text))}| end")
    return "\n".join(lines)


def pin(session, text: str | None) -> str:
    """/pin TEXT keeps that piece of a document the chat has read hot (added to the pieces kept); /unpin (None) keeps
    none. What happened, in a line."""
    try:
        missing = session.set_pins([] if text is None else [*session.pins, text])
    except EngineError as exc:
        return f"(not kept: {exc})"
    if text is None:
        return "(nothing is kept hot now: the cache decides again)"
    if text in missing:
        return "(kept, but no document the chat has read holds that text yet: looked for again after each message)"
    return f"(kept hot: {len(session.pins)} piece{'s' if len(session.pins) != 1 else ''}; /unpin lets the cache decide again)"
