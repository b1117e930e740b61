"""Text extraction for files a user drops into the chat.

``load_document(path)`` turns a plain-text, Markdown, source-code, PDF or Word (.docx) file into a
:class:`Document` holding normalised text; ``format_for_prompt(doc)`` wraps that text in the block
inserted into the chat turn.  Every failure is a :class:`DocumentError` whose message names the file
and says what the user can do about it, and whose ``reason`` is a short code the UI can switch on.

The package is headless (no Qt), keeps no global state and only reads the file it is given, so the
GUI may call it from any worker thread, several at once.

This module holds the public API; ``load_document`` lives here, so code that looks it up as
``engine.documents.load_document`` sees a replacement set on the package. The readers are split by
kind: ``core`` (supported kinds, :class:`Document`, :class:`DocumentError`, shared helpers),
``text`` (plain text and its encoding), ``pdf`` and ``word`` (.docx). They import from ``core``
and never from this module.
"""

from __future__ import annotations

import html
import os
import re
import stat

from .core import (
    _HINTS,
    DEFAULT_MAX_BYTES,
    DEFAULT_MAX_CHARS,
    SUPPORTED_SUFFIXES,
    Document,
    DocumentError,
    _kind_for,
    _normalise,
    _size,
    _supported_summary,
    is_supported,
)
from .pdf import _clean_pdf_text, _looks_scanned, _normalise_pdf_spacing, _pdf_text, _scanned_message
from .text import _decode_text
from .web import NOTE as _WEB_NOTE
from .web import WEB_SUFFIXES as _WEB_SUFFIXES
from .web import is_page as _is_web_page
from .web import page_text as _web_page_text
from .word import _docx_text

__all__ = [
    "DEFAULT_MAX_BYTES",
    "DEFAULT_MAX_CHARS",
    "SUPPORTED_SUFFIXES",
    "Document",
    "DocumentError",
    "format_for_prompt",
    "is_supported",
    "load_document",
]


# --------------------------------------------------------------------------------------------------
# Entry points
# --------------------------------------------------------------------------------------------------


def load_document(
    path: str | os.PathLike[str],
    *,
    max_bytes: int = DEFAULT_MAX_BYTES,
    max_chars: int = DEFAULT_MAX_CHARS,
) -> Document:
    """Read ``path`` and return its text as a :class:`Document`; raise :class:`DocumentError`."""
    given = os.fspath(path)
    if isinstance(given, bytes):
        given = os.fsdecode(given)
    if given.startswith("~"):
        given = os.path.expanduser(given)  # typed, not run through a shell
    name = os.path.basename(os.path.normpath(given)) or given
    label = f'"{name}"'

    def fail(reason: str, message: str) -> DocumentError:
        return DocumentError(message, path=given, reason=reason)

    # --- the file itself -------------------------------------------------------------------------
    try:
        st = os.stat(given)
    except FileNotFoundError:
        raise fail(
            "missing", f"{label} was not found at {given}. It may have been moved or deleted."
        ) from None
    except NotADirectoryError:
        raise fail("missing", f"{label} was not found at {given}.") from None
    except PermissionError:
        raise fail("unreadable", f"{label} could not be opened: permission denied.") from None
    except OSError as exc:
        raise fail("unreadable", f"{label} could not be opened: {exc.strerror or exc}.") from None
    if stat.S_ISDIR(st.st_mode):
        raise fail("missing", f"{label} is a folder, not a file. Drop the files inside it instead.")
    if not stat.S_ISREG(st.st_mode):
        raise fail("unreadable", f"{label} is not a regular file (device, pipe or socket).")

    kind = _kind_for(given)
    if kind is None:
        suffix = os.path.splitext(name)[1].lower()
        hint = _HINTS.get(suffix)
        what = f"{suffix} files" if suffix else "files without a suffix"
        message = f"{label} can't be read: {what} are not supported. "
        raise fail("unsupported", message + (hint + " " if hint else "") + _supported_summary())

    if st.st_size > max_bytes:
        raise fail(
            "too_large",
            f"{label} is {_size(st.st_size)}; the limit is {_size(max_bytes)}. "
            "Split it into smaller files or drop an excerpt.",
        )

    try:
        with open(given, "rb") as fh:
            data = fh.read(max_bytes + 1)
    except PermissionError:
        raise fail("unreadable", f"{label} could not be opened: permission denied.") from None
    except OSError as exc:
        raise fail("unreadable", f"{label} could not be read: {exc.strerror or exc}.") from None
    if len(data) > max_bytes:  # grew between stat() and read()
        raise fail(
            "too_large",
            f"{label} is more than {_size(max_bytes)}, the limit. Split it into smaller files or drop an excerpt.",
        )

    # --- extraction ------------------------------------------------------------------------------
    pages: int | None = None
    notes: list[str] = []
    if kind == "pdf":
        text, pages = _pdf_text(data, label, fail, max_chars)
        text = _clean_pdf_text(_normalise_pdf_spacing(text), notes)
    elif kind == "docx":
        text = _docx_text(data, label, fail, max_bytes)
    else:
        text = _decode_text(data, label, fail, notes)
        if os.path.splitext(name)[1].lower() in _WEB_SUFFIXES and _is_web_page(text):
            kind = "web"
            text = _web_page_text(text)
            notes.append(_WEB_NOTE)

    text = _normalise(text)

    if len(text) > max_chars:
        raise fail(
            "too_large",
            f"{label} has {len(text):,} characters of text; the limit is {max_chars:,}. "
            "Split it into smaller files or drop an excerpt.",
        )
    if not text.strip():
        if kind == "pdf":
            raise fail("empty", _scanned_message(label))
        if kind == "web":
            raise fail("empty", f"{label} is a web page with no text of its own (its scripts build what it shows). "
                                "Copy the text from the browser into a .txt file and drop that instead.")
        raise fail("empty", f"{label} contains no text.")
    if kind == "pdf" and _looks_scanned(text, pages or 0):
        raise fail("empty", _scanned_message(label))

    return Document(
        name=name,
        path=os.path.abspath(given),
        kind=kind,
        text=text,
        pages=pages,
        chars=len(text),
        notes=tuple(notes),
    )


def format_for_prompt(doc: Document) -> str:
    """The block inserted into the chat turn: ``<document name="...">\\n...text...\\n</document>``.

    The name is attribute-escaped; a literal ``</document>`` inside the text is defused so the
    block cannot be closed early by the file's content.
    """
    name = html.escape(doc.name, quote=True)
    body = _CLOSING_TAG.sub(r"<\\/document>", doc.text)
    return f'<document name="{name}">\n{body}\n</document>'


_CLOSING_TAG = re.compile(r"</document>", re.IGNORECASE)


def user_content(prompt: str, documents=()) -> str:
    """A user turn's text as the model reads it: each document's block, then the question (which comes last,
    so its attention scores the documents). Lone surrogates and the like are replaced (chat_template.clean_text)."""
    from ..chat_template import clean_text

    blocks = [clean_text(format_for_prompt(d)) for d in documents]
    return "\n\n".join(blocks + [clean_text(prompt)]) if blocks else clean_text(prompt)
