"""The terminal's documents: `--document` and `/doc` paths read as the app reads what is dropped on it, a folder
giving the documents inside it (documents/folder.py), and a /doc line parsed as a terminal pastes a dragged file."""

from __future__ import annotations

import os
import shlex
import sys

from .errors import EngineError


def expand(path: str):
    """The files a path gives: itself, or the documents inside a folder (a folder without any is a DocumentError).
    With them the folder's FolderDocuments, or None for a file."""
    from .documents.folder import documents_or_refuse

    if not os.path.isdir(os.path.expanduser(path)):
        return [path], None
    found = documents_or_refuse(os.path.expanduser(path))
    return found.files, found


def documents(paths: list[str]) -> list:
    """The --document files (or folders) read before the model loads (a bad one fails at once, without the wait)."""
    from .documents import load_document

    docs = []
    for path in paths:
        files, found = expand(path)
        docs += [load_document(one) for one in files]
        if found is not None and found.summary():
            print(f"({found.summary()})", file=sys.stderr)
    return docs


def attach(path: str, pending: list, model=None) -> None:
    """Read a /doc or --document file now (a folder: each document in it, then what the folder gave): its error (or
    its size) is said at once, and only good files wait. With the model, a file too large for the context is said at
    once too (it stays attached until /doc clear)."""
    from .documents import load_document

    try:
        files, found = expand(path)
    except EngineError as exc:
        print(f"error: {exc} (not attached)", file=sys.stderr)
        return
    read = []
    for one in files:
        try:
            doc = load_document(one)
        except EngineError as exc:
            print(f"error: {exc} (not attached)", file=sys.stderr)
            continue
        read.append(one)
        pending.append(doc)
        notes = "".join(f"; {note}" for note in doc.notes)
        print(f"(attached {doc.name}, {doc.chars:,} characters, to the next message{notes})", file=sys.stderr)
        if model is not None:
            tokens = model.document_tokens(doc)
            if tokens >= model.context_limit:
                print(f"warning: {doc.name} is {tokens:,} tokens and the context holds {model.context_limit:,}: no "
                      f"message can carry it. /doc clear drops it; a larger context needs --max-seq-len (up to the "
                      f"model's {model.max_positions:,} positions) when the chat starts.", file=sys.stderr)
    said = found.summary(tuple(p for p in found.files if p not in read)) if found is not None else ""
    if said:
        print(f"({said})", file=sys.stderr)


def doc_command(rest: str, pending: list, model) -> list:
    """/doc PATH attaches the file(s) or folder it names, /doc clear drops what is attached, /doc lists it. The
    documents attached to the next message after it."""
    if rest == "clear":
        print(f"({names(pending)} no longer attached)" if pending else "(nothing was attached)", file=sys.stderr)
        return []
    if rest:
        for one in typed_paths(rest):
            attach(one, pending, model)
    elif pending:
        print(f"(attached to the next message: {names(pending)}; /doc clear removes them)", file=sys.stderr)
    else:
        print("usage: /doc PATH attaches a file (or a folder's documents) to the next message (nothing is attached now)",
              file=sys.stderr)
    return pending


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
