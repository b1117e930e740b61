"""Text extraction for files a user drops into the chat.

``load_document(path)`` turns a plain-text, Markdown, source-code, web-page, PDF or Word (.docx) file into a
:class:`Document` holding normalised text; ``format_for_prompt(doc)`` wraps that text in the block
inserted into the chat turn.  Every failure is a :class:`DocumentError` whose message names the file
and says what the user can do about it, and whose ``reason`` is a short code the UI can switch on.

The package is headless (no Qt), keeps no global state and only reads the file it is given, so the
GUI may call it from any worker thread, several at once.

This module holds the public API; ``load_document`` lives here, so code that looks it up as
``engine.documents.load_document`` sees a replacement set on the package. The readers are split by
kind: ``core`` (supported kinds, :class:`Document`, :class:`DocumentError`, shared helpers),
``text`` (plain text and its encoding), ``pdf``, ``word`` (.docx) and ``web``; ``sniff`` says what a
file is from its content's signature, which wins over a name that lies (a PDF saved as "report.txt"
or with no suffix is read as a PDF, with a note saying so; text under a .pdf or .docx name is read as text, unless
it is a web page or a server's reply that a failed download saved). They import from ``core`` and never from
this module.
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
from .sniff import _OLE_MAGIC, Found, identify
from .text import _decode_text
from .web import NOTE as _WEB_NOTE
from .web import WEB_SUFFIXES as _WEB_SUFFIXES
from .web import is_page as _is_web_page
from .web import page_text as _web_page_text
from .web import served as _served
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

    # --- what the file is: its name says, unless its content's signature says otherwise (sniff.py) ----
    claimed = _kind_for(given)  # by the suffix; None for an unknown suffix or none
    suffix = os.path.splitext(name)[1].lower()

    def unsupported(found: Found | None = None) -> DocumentError:
        if found is not None and suffix not in found.suffixes:  # the name lies: say what the file really is
            if claimed is None:
                return fail(found.reason, f"{label} can't be read: it is {found.what}. {found.advice}")
            return fail(found.reason, f"{label} is really {found.what}, not {_CLAIMED.get(claimed, 'a text file')}. "
                                      f"{found.advice}")
        hint = _HINTS.get(suffix)
        message = (f"{label} can't be read: {suffix} files are not supported. " if suffix else
                   f"{label} can't be read: it has no suffix, and its content is not PDF, Word or text. ")
        return fail("unsupported", message + (hint + " " if hint else "") + _supported_summary())

    if st.st_size > max_bytes:
        if claimed is None:  # a large program or video says what it is, not that it is large
            head = _read(given, 65536, fail, label)
            found = identify(head)
            if found is not None and found.reader is None:
                raise unsupported(found)
            if found is None and b"\x00" in head[:8192]:
                raise unsupported()
        raise fail(
            "too_large",
            f"{label} is {_size(st.st_size)}; the limit is {_size(max_bytes)}. "
            "Split it into smaller files or drop an excerpt.",
        )

    data = _read(given, max_bytes + 1, fail, label)
    if len(data) > max_bytes:  # grew between stat() and read()
        raise fail(
            "too_large",
            f"{label} is more than {_size(max_bytes)}, the limit. Split it into smaller files or drop an excerpt.",
        )

    notes: list[str] = []
    kind = claimed or "text"  # a file of no known suffix is read as text when it is text
    found = identify(data)
    renamed = found is not None and found.reader is not None and found.reader != claimed
    if renamed:  # a PDF named .txt, a .docx renamed .pdf, a PDF saved without a suffix: the content decides
        kind = found.reader
        notes.append(f"{label} is {found.what}; read as {_READ_AS[kind]}.")
    elif found is not None and found.reader is None:
        if not (claimed == "docx" and data.startswith(_OLE_MAGIC)  # the Word reader names a .doc or a password
                or claimed in _TEXT_KINDS and found.text):  # an RTF named .txt is the text it is
            raise unsupported(found)
    prose = None  # text under a .pdf / .docx name, decoded already
    if found is None and claimed in _CLAIMED and b"%PDF-" not in data[:1024]:  # no PDF, zip or OLE signature
        prose = _text_named_binary(data, label, claimed, fail, notes)

    # --- extraction ------------------------------------------------------------------------------
    web = suffix in _WEB_SUFFIXES or claimed is None  # a page saved as .txt is read as its source
    try:
        kind, text, pages = ("text", prose, None) if prose is not None else \
            _extract(kind, data, f"{label} ({found.what})" if renamed else label, fail, notes, max_bytes, max_chars,
                     web=web)
    except DocumentError as exc:
        if claimed is None and not renamed and exc.reason == "binary":
            raise unsupported() from None  # no suffix it could be read by, and not text either
        if not renamed or claimed in ("pdf", "docx") or data.startswith(b"%PDF-"):
            raise
        # A text that only quotes a PDF's header and an object (further in than its first bytes) did not read as
        # a PDF: it is read as the text it is when the text reader takes it; otherwise the PDF's error stands.
        notes = []
        try:
            kind, text, pages = _extract(claimed or "text", data, label, fail, notes, max_bytes, max_chars, web=web)
        except DocumentError:
            raise exc from None
        renamed = False
    if claimed is None and kind == "text":
        notes.insert(0, f"{label} is a text file; read as text.")
    if renamed:
        label = f"{label} ({found.what})"  # what is said about its text from here on names what it is

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


_TEXT_KINDS = ("text", "markdown", "source")
_CLAIMED = {"pdf": "a PDF", "docx": "a Word document"}  # what a suffix promised (a text suffix: "a text file")
_READ_AS = {"pdf": "PDF", "docx": "Word"}


def _text_named_binary(data: bytes, label: str, claimed: str, fail, notes: list[str]) -> str | None:
    """A file under a .pdf or .docx name whose content has no PDF, zip or OLE signature: its text (with a note) when
    it is prose, None when it is not text at all (the `claimed` kind's reader says what is wrong). A file that is
    empty, a web page or a server's reply (XML, JSON) is refused: a failed download saves that under the name of
    the file it was meant to fetch."""
    promised = _CLAIMED[claimed]
    if not data.strip():
        size = f"{_size(len(data))} of blank space" if data else "0 bytes"
        raise fail("empty", f"{label} is empty ({size}), not {promised}: the download or copy may have failed. "
                            "Download or copy it again.")
    decoded: list[str] = []
    try:
        source = _decode_text(data, label, fail, decoded)
    except DocumentError:
        return None
    served = _served(source)
    if served is not None:
        what, why, suffix = served
        raise fail("unreadable", f"{label} is really {what}, not {promised}: it may be {why} saved instead of the "
                                 f"file. Download the file again (if it is what you meant to drop, rename it to "
                                 f"{suffix} and drop it again).")
    notes += [f"{label} is a text file, not {promised}; read as text.", *decoded]
    return source


def _read(given: str, limit: int, fail, label: str) -> bytes:
    try:
        with open(given, "rb") as fh:
            return fh.read(limit)
    except PermissionError:
        raise fail("unreadable", f"{label} could not be opened: permission denied.") from None
    except OSError as exc:
        raise fail("unreadable", f"{label} could not be read: {exc.strerror or exc}.") from None


def _extract(kind: str, data: bytes, label: str, fail, notes: list[str], max_bytes: int, max_chars: int, *,
             web: bool) -> tuple[str, str, int | None]:
    """(kind, text, pages) of `data` read as `kind`; a text that is a whole web page becomes "web" when `web`."""
    if kind == "pdf":
        text, pages = _pdf_text(data, label, fail, max_chars, notes)
        return kind, _clean_pdf_text(_normalise_pdf_spacing(text), notes), pages
    if kind == "docx":
        return kind, _docx_text(data, label, fail, max_bytes), None
    text = _decode_text(data, label, fail, notes)
    if web and _is_web_page(text):
        notes.append(_WEB_NOTE)
        return "web", _web_page_text(text), None
    return kind, text, None


def format_for_prompt(doc: Document) -> str:
    """The block inserted into the chat turn: ``<document name="...">\\n...text...\\n</document>``.

    The name is attribute-escaped; a literal ``</document>`` inside the text is defused so the
    block cannot be closed early by the file's content.
    """
    name = html.escape(doc.name, quote=True)
    return f'{BLOCK_OPENING}{name}">\n{defuse(doc.text)}{BLOCK_CLOSING}'


BLOCK_OPENING = '<document name="'  # a document's block in a user turn starts so, its text after the line's end,
BLOCK_CLOSING = "\n</document>"  # and ends so (engine.heat finds documents in a conversation by them)
CLOSING_TAG = re.compile(r"</document>", re.IGNORECASE)


def defuse(text: str) -> str:
    """A document's text as its block holds it: each closing tag inside it with one character more."""
    return CLOSING_TAG.sub(r"<\\/document>", text)


def user_content(prompt: str, documents=()) -> str:
    """A user turn's text as the model reads it: each document's block, then the question (which comes last,
    so its attention scores the documents). Lone surrogates and the like are replaced (chat_template.clean_text)."""
    from ..chat_template import clean_text

    blocks = [clean_text(format_for_prompt(d)) for d in documents]
    return "\n\n".join(blocks + [clean_text(prompt)]) if blocks else clean_text(prompt)
