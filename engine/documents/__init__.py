"""Text extraction for files a user drops into the chat.

``load_document(path)`` turns a plain-text, Markdown, source-code, PDF or Word (.docx) file into a
:class:`Document` holding normalised text; ``format_for_prompt(doc)`` wraps that text in the block
inserted into the chat turn.  Every failure is a :class:`DocumentError` whose message names the file
and says what the user can do about it, and whose ``reason`` is a short code the UI can switch on.

The module is headless (no Qt), keeps no global state and only reads the file it is given, so the
GUI may call it from any worker thread, several at once.
"""

from __future__ import annotations

import html
import io
import os
import re
import stat
import unicodedata
import zipfile
from dataclasses import dataclass

from engine.errors import EngineError

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

DEFAULT_MAX_BYTES = 64 * 1024 * 1024
DEFAULT_MAX_CHARS = 2_000_000

# --------------------------------------------------------------------------------------------------
# What is supported
# --------------------------------------------------------------------------------------------------

_TEXT_SUFFIXES = frozenset(
    {
        ".txt", ".text", ".log", ".csv", ".tsv", ".json", ".jsonl", ".ndjson", ".rst", ".org",
        ".adoc", ".srt", ".vtt",
    }
)  # fmt: skip
_MARKDOWN_SUFFIXES = frozenset({".md", ".markdown", ".mdown", ".mkd", ".mdx"})
_SOURCE_SUFFIXES = frozenset(
    {
        # general purpose languages
        ".py", ".pyi", ".pyx", ".js", ".mjs", ".cjs", ".jsx", ".ts", ".tsx", ".c", ".h", ".cc",
        ".cpp", ".cxx", ".hpp", ".hh", ".hxx", ".cu", ".cuh", ".cs", ".java", ".kt", ".kts",
        ".scala", ".go", ".rs", ".rb", ".php", ".pl", ".pm", ".lua", ".r", ".swift", ".m", ".mm",
        ".dart", ".hs", ".ml", ".mli", ".ex", ".exs", ".erl", ".clj", ".jl", ".f90", ".zig",
        ".nim", ".v", ".vhd", ".asm", ".s",
        # shells and scripts
        ".sh", ".bash", ".zsh", ".fish", ".ps1", ".bat", ".cmd",
        # configuration and data languages
        ".toml", ".yaml", ".yml", ".ini", ".cfg", ".conf", ".properties", ".xml", ".proto",
        ".graphql", ".cmake", ".mk", ".gradle", ".dockerfile", ".diff", ".patch",
        # web and markup
        ".html", ".htm", ".css", ".scss", ".sass", ".less", ".vue", ".svelte", ".sql", ".tex",
        ".bib",
    }
)  # fmt: skip
_PDF_SUFFIXES = frozenset({".pdf"})
_DOCX_SUFFIXES = frozenset({".docx"})

SUPPORTED_SUFFIXES: frozenset[str] = (
    _TEXT_SUFFIXES | _MARKDOWN_SUFFIXES | _SOURCE_SUFFIXES | _PDF_SUFFIXES | _DOCX_SUFFIXES
)

# Well-known files that carry no suffix (compared case-insensitively).
_BARE_NAMES = {
    "makefile": "source",
    "gnumakefile": "source",
    "dockerfile": "source",
    "containerfile": "source",
    "readme": "text",
    "license": "text",
    "licence": "text",
    "copying": "text",
    "authors": "text",
    "changelog": "text",
    "notice": "text",
}

# Suffixes we know and refuse with a specific hint instead of the generic list.
_HINTS = {
    ".doc": "Old Word .doc files are not supported; open it in Word or LibreOffice and save it as .docx.",
    ".rtf": "Save it as .docx or plain text (.txt) and drop that instead.",
    ".odt": "Save it as .docx (File > Save As > Word) and drop that instead.",
    ".pages": "Export it as .docx or PDF and drop that instead.",
    ".xlsx": "Spreadsheets are not supported; export the sheet as .csv and drop that instead.",
    ".xls": "Spreadsheets are not supported; export the sheet as .csv and drop that instead.",
    ".pptx": "Presentations are not supported; export it as PDF and drop that instead.",
    ".ppt": "Presentations are not supported; export it as PDF and drop that instead.",
    ".epub": "E-books are not supported; convert it to PDF or plain text first.",
}


def _kind_for(path: str | os.PathLike[str]) -> str | None:
    name = os.path.basename(os.fspath(path))
    suffix = os.path.splitext(name)[1].lower()
    if suffix in _PDF_SUFFIXES:
        return "pdf"
    if suffix in _DOCX_SUFFIXES:
        return "docx"
    if suffix in _MARKDOWN_SUFFIXES:
        return "markdown"
    if suffix in _SOURCE_SUFFIXES:
        return "source"
    if suffix in _TEXT_SUFFIXES:
        return "text"
    if not suffix:
        return _BARE_NAMES.get(name.lower())
    return None


def is_supported(path: str | os.PathLike[str]) -> bool:
    """True when ``load_document`` knows how to read a file with this name (by suffix only)."""
    return _kind_for(path) is not None


def _supported_summary() -> str:
    text = ", ".join(sorted(_TEXT_SUFFIXES | _MARKDOWN_SUFFIXES))
    source = ", ".join(sorted(_SOURCE_SUFFIXES))
    return f"Supported: PDF (.pdf), Word (.docx), text ({text}) and source code ({source})."


# --------------------------------------------------------------------------------------------------
# Public types
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Document:
    """Text extracted from one file."""

    name: str  # file name shown to the model and UI (basename)
    path: str  # absolute path of the file read
    kind: str  # "text" | "markdown" | "source" | "pdf" | "docx"
    text: str  # normalised text: "\n" line endings, no NULs, at most two blank lines in a row
    pages: int | None  # number of pages for a PDF; None otherwise
    chars: int  # len(text)
    notes: tuple[str, ...] = ()  # what the reader should know: bytes replaced, the encoding guessed


class DocumentError(EngineError, ValueError):
    """A file could not be turned into text; ``str(err)`` is a message the user can act on.

    ``reason`` is one of "missing", "unsupported", "binary", "encrypted", "too_large",
    "unreadable", "empty"; ``path`` is the path that was given.
    """

    REASONS = frozenset({"missing", "unsupported", "binary", "encrypted", "too_large", "unreadable", "empty"})

    def __init__(self, message: str, *, path: str, reason: str) -> None:
        if reason not in self.REASONS:
            raise ValueError(f"unknown DocumentError reason {reason!r}")
        super().__init__(message)
        self.path = path
        self.reason = reason

    def __reduce__(self):  # keep path/reason when pickled (e.g. across a process pool)
        return (_rebuild_error, (str(self), self.path, self.reason))


def _rebuild_error(message: str, path: str, reason: str) -> DocumentError:
    return DocumentError(message, path=path, reason=reason)


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


# --------------------------------------------------------------------------------------------------
# Helpers: sizes and normalisation
# --------------------------------------------------------------------------------------------------


def _size(n: int) -> str:
    if n < 1024:
        return f"{n:,} bytes"
    value = n / 1024
    unit = "KiB"
    for bigger in ("MiB", "GiB", "TiB"):
        if value < 1024:
            break
        value /= 1024
        unit = bigger
    return f"{value:,.1f} {unit} ({n:,} bytes)"


_BLANK_RUN = re.compile(r"\n(?:[ \t]*\n){3,}")
_LEADING_BLANK_LINES = re.compile(r"\A(?:[ \t]*\n)+")


def _normalise(text: str) -> str:
    text = text.replace("\x00", "")
    if text.startswith("\ufeff"):
        text = text[1:]
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    text = _BLANK_RUN.sub("\n\n\n", text)  # at most two blank lines in a row
    text = _LEADING_BLANK_LINES.sub("", text)
    return text.rstrip()


# --------------------------------------------------------------------------------------------------
# Plain text
# --------------------------------------------------------------------------------------------------

_SNIFF = 8192
# C0 controls that do not occur in text (tab, LF, VT, FF, CR and ESC do).
_CONTROL_BYTES = bytes(b for b in range(32) if b not in (9, 10, 11, 12, 13, 27)) + b"\x7f"
_CONTROL_CHARS = frozenset(chr(b) for b in _CONTROL_BYTES)
_CONTROL_TRANSLATE = bytes.maketrans(_CONTROL_BYTES, b"\x00" * len(_CONTROL_BYTES))

_BOMS = (
    (b"\x00\x00\xfe\xff", "utf-32-be", 4),
    (b"\xff\xfe\x00\x00", "utf-32-le", 4),  # must precede the UTF-16 LE BOM it starts with
    (b"\xef\xbb\xbf", "utf-8", 3),
    (b"\xfe\xff", "utf-16-be", 2),
    (b"\xff\xfe", "utf-16-le", 2),
)


def _control_ratio_bytes(head: bytes) -> float:
    if not head:
        return 0.0
    return head.translate(_CONTROL_TRANSLATE).count(0) / len(head)


def _control_ratio_chars(head: str) -> float:
    if not head:
        return 0.0
    return sum(ch in _CONTROL_CHARS for ch in head) / len(head)


def _decode_text(data: bytes, label: str, fail, notes: list[str]) -> str:
    not_text = (
        f"{label} doesn't look like a text file (it contains binary data). "
        "If it is text in another encoding, save it as UTF-8 and drop it again."
    )

    # 1. A byte-order mark says exactly how to decode.
    for bom, encoding, width in _BOMS:
        if data.startswith(bom):
            body = data[width:]
            try:
                text = body.decode(encoding)
            except UnicodeDecodeError:
                text = body.decode(encoding, errors="replace")
                bad = text.count("\ufffd")
                if bad > max(1, len(text) // 1000):
                    raise fail("binary", not_text) from None
                notes.append(_replaced_note(bad, encoding.upper()))
            if _control_ratio_chars(text[:_SNIFF]) > 0.05:
                raise fail("binary", not_text)
            return text

    # 2. No BOM: the first 8 KiB decide whether this is text at all.
    head = data[:_SNIFF]
    if b"\x00" in head:
        raise fail(
            "binary",
            f"{label} doesn't look like a text file (it contains NUL bytes). "
            "If it is UTF-16 text without a byte-order mark, save it as UTF-8 and drop it again.",
        )
    if _control_ratio_bytes(head) > 0.05:
        raise fail("binary", not_text)

    # 3. UTF-8, the overwhelmingly common case (Chinese included).
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        pass

    # 4. UTF-8 with some invalid bytes (a pasted Windows-1252 quote, a damaged download): when it holds at
    #    least as many valid multi-byte characters as invalid bytes it is UTF-8, whose characters a legacy
    #    code page would turn into mojibake ("café" -> "cafÃ©"). The replaced bytes are said.
    lenient = data.decode("utf-8", errors="replace")
    bad = lenient.count("\ufffd") - data.count(b"\xef\xbf\xbd")
    good_non_ascii = sum(1 for ch in lenient if ord(ch) > 127) - lenient.count("\ufffd")
    if good_non_ascii >= bad > 0:
        notes.append(_replaced_note(bad, "UTF-8"))
        return lenient

    # 5. A legacy encoding: a maintained detector (charset-normalizer) decides; never UTF-16/32 without a BOM.
    guess = _detect_legacy(data)
    if guess is not None:
        encoding, text = guess
        notes.append(f"not UTF-8: read as {encoding}")
        return text

    # 6. Nothing credible: Windows-1252 for bytes that look like text (few high bytes), else refuse.
    high = sum(1 for b in head if b >= 0x80)
    if high / max(1, len(head)) > 0.3:
        raise fail(
            "binary",
            f"{label} is not UTF-8 and its encoding could not be recognised. "
            "Save it as UTF-8 and drop it again.",
        )
    notes.append("not UTF-8: read as Windows-1252")
    try:
        return data.decode("cp1252")
    except UnicodeDecodeError:
        return data.decode("latin-1")


def _replaced_note(count: int, encoding: str) -> str:
    return f"{count} byte{'s' if count != 1 else ''} not valid {encoding}, replaced with \ufffd"


_WIDE_ENCODINGS = ("utf_16", "utf_16_be", "utf_16_le", "utf_32", "utf_32_be", "utf_32_le", "utf_7")


def _detect_legacy(data: bytes) -> tuple[str, str] | None:
    """(encoding, text) by charset-normalizer, or None when it finds nothing credible."""
    try:
        from charset_normalizer import from_bytes
    except ImportError:  # pragma: no cover - a declared dependency
        return None
    matches = list(from_bytes(data, cp_exclusion=list(_WIDE_ENCODINGS)))
    if not matches:
        return None
    best = matches[0]
    # Code pages that decode a text equally well tie; the detector then names any of them (Central European
    # cp1250 for mostly-English text with a few accents, say). Ties go to the code page most text is in.
    tied = [m for m in matches if m.chaos == best.chaos and m.coherence == best.coherence]
    for common in _COMMON_CODE_PAGES:
        found = next((m for m in tied if common in m.could_be_from_charset), None)
        if found is not None:
            best, encoding = found, common
            break
    else:
        encoding = best.encoding
    if encoding.startswith("utf"):
        return None
    if len(data) < 64 and encoding != "cp1252":
        return None  # too little text to tell one code page from another
    return encoding.replace("_", "-"), data.decode(encoding, errors="replace")


# By how much text is written in them (Windows-1252 first), for ties between equally good code pages.
_COMMON_CODE_PAGES = ("cp1252", "gb18030", "big5", "cp932", "shift_jis", "cp949", "euc_kr", "cp1251", "cp1250",
                      "cp1253", "cp1254", "cp1255", "cp1256", "cp1257", "cp1258", "koi8_r", "latin_1")


# --------------------------------------------------------------------------------------------------
# PDF
# --------------------------------------------------------------------------------------------------


def _scanned_message(label: str) -> str:
    return (
        f"{label} has no extractable text; it looks like a scanned document (pages stored as images). "
        "Run OCR on it first (for example with OCRmyPDF or Adobe Acrobat) and drop the result."
    )


_PDF_SPACING = re.compile(r"[ \t\u00a0\u2000-\u200a\u202f\u205f\u3000]+")


# Presentation forms a PDF's text layer uses for what is plain text: ligatures (ﬁ ﬂ ﬀ, LaTeX and Qt
# write them) and the Kangxi / CJK radicals Qt's writer maps ideographs such as 户 and 目 to.
_PDF_COMPAT = re.compile("[\ufb00-\ufb06\u2e80-\u2ef3\u2f00-\u2fd5]")
# C0 controls in extracted text are glyphs the PDF gives no character for (its ToUnicode map omits them)
_PDF_UNMAPPED = re.compile("[\x01-\x08\x0b\x0c\x0e-\x1f\x7f]")


def _clean_pdf_text(text: str, notes: list[str]) -> str:
    """Ligatures and radicals become the characters they stand for (NFKC, for those alone); glyphs the PDF
    maps to no character become U+FFFD, and a note says how many (the model must not read them as text)."""
    text = _PDF_COMPAT.sub(lambda m: unicodedata.normalize("NFKC", m.group()), text)
    text, unmapped = _PDF_UNMAPPED.subn("\ufffd", text)
    if unmapped:
        notes.append(f"{unmapped:,} character{'s' if unmapped != 1 else ''} of this PDF could not be read (its text "
                     "layer gives no character for them; they show as \ufffd): numbers or names may be missing. "
                     "Export the PDF again from its source, or drop the source file instead.")
    return text


def _normalise_pdf_spacing(text: str) -> str:
    """Runs of spaces, tabs and other spacing characters a PDF's text layer puts between words become one
    space (Qt's QPdfWriter, for one, joins words with tabs, which tokenize as separate tokens and nearly
    doubled a speech's token count); line breaks stay."""
    return "\n".join(_PDF_SPACING.sub(" ", line).strip(" ") for line in text.split("\n"))


def _looks_scanned(text: str, pages: int) -> bool:
    """Too few letters or digits for the page count: at most page numbers or stamps survived."""
    needed = 3 * max(1, pages)
    letters = 0
    for ch in text:
        if ch.isalnum():
            letters += 1
            if letters >= needed:
                return False
    return True


def _reason_of(exc: BaseException) -> str:
    detail = str(exc).strip() or type(exc).__name__
    if len(detail) > 200:
        detail = detail[:197] + "..."
    return detail


def _pdf_text(data: bytes, label: str, fail, max_chars: int) -> tuple[str, int]:
    try:
        from pypdf import PdfReader
        from pypdf.errors import DependencyError
    except ImportError as exc:  # pragma: no cover - pypdf is a declared dependency
        raise fail(
            "unreadable", f"{label} can't be read: PDF support (pypdf) is not installed ({exc})."
        ) from None

    if b"%PDF-" not in data[:1024]:
        raise fail(
            "unreadable",
            f"{label} is not a valid PDF file (no PDF header). It may be damaged or mislabelled.",
        )

    try:
        reader = PdfReader(io.BytesIO(data), strict=False)
    except Exception as exc:
        raise fail("unreadable", f"{label} could not be read as a PDF: {_reason_of(exc)}.") from None

    try:
        encrypted = reader.is_encrypted
    except Exception as exc:
        raise fail("unreadable", f"{label} could not be read as a PDF: {_reason_of(exc)}.") from None
    aes_message = (
        f"{label} is encrypted with AES, which this installation cannot decrypt. "
        "Save an unprotected copy (open it and print or export it to a new PDF) and drop that."
    )
    if encrypted:
        protected = (
            f"{label} is password-protected. Remove the password (for example: open it and print or "
            "export it to a new PDF) and drop the unprotected copy."
        )
        try:
            opened = reader.decrypt("")
        except DependencyError:
            raise fail("encrypted", aes_message) from None
        except Exception as exc:
            raise fail(
                "unreadable", f"{label} is encrypted and could not be opened: {_reason_of(exc)}."
            ) from None
        if not opened:
            raise fail("encrypted", protected)

    try:
        page_list = reader.pages
        n_pages = len(page_list)
    except Exception as exc:
        raise fail("unreadable", f"{label} could not be read as a PDF: {_reason_of(exc)}.") from None
    if n_pages == 0:
        raise fail("unreadable", f"{label} could not be read as a PDF: it has no pages.")

    parts: list[str] = []
    total = 0
    failures: list[tuple[int, BaseException]] = []
    for index in range(n_pages):
        try:
            page_text = page_list[index].extract_text() or ""
        except Exception as exc:  # a damaged page: mark it, keep the rest
            if encrypted and isinstance(exc, DependencyError):  # AES streams, no crypto library
                raise fail("encrypted", aes_message) from None
            failures.append((index + 1, exc))
            parts.append(f"[page {index + 1}: text could not be extracted]")
            continue
        page_text = page_text.strip("\n")
        if page_text.strip():
            parts.append(page_text)
            total += len(page_text) + 2
            # Normalisation only shrinks text, and only a little; stop reading hopeless cases early.
            if total > 2 * max_chars + 1024:
                raise fail(
                    "too_large",
                    f"{label} has more than {max_chars:,} characters of text (stopped reading at page "
                    f"{index + 1} of {n_pages}); the limit is {max_chars:,}. "
                    "Split it into smaller files or drop an excerpt.",
                )
    if failures and len(failures) == n_pages:
        page, exc = failures[0]
        raise fail("unreadable", f"{label} could not be read as a PDF: page {page}: {_reason_of(exc)}.")
    return "\n\n".join(parts), n_pages


# --------------------------------------------------------------------------------------------------
# Word (.docx)
# --------------------------------------------------------------------------------------------------

_OLE_MAGIC = b"\xd0\xcf\x11\xe0\xa1\xb1\x1a\xe1"


def _docx_text(data: bytes, label: str, fail, max_bytes: int) -> str:
    try:
        import docx  # python-docx
    except ImportError as exc:  # pragma: no cover - python-docx is a declared dependency
        raise fail(
            "unreadable", f"{label} can't be read: Word support (python-docx) is not installed ({exc})."
        ) from None

    if data.startswith(_OLE_MAGIC):
        if "EncryptedPackage".encode("utf-16-le") in data:
            raise fail(
                "encrypted",
                f"{label} is password-protected. Open it in Word, remove the password "
                "(File > Info > Protect Document > Encrypt with Password, clear it), save, and drop it again.",
            )
        raise fail(
            "unreadable",
            f"{label} is an old Word .doc file with a .docx name. Open it in Word or LibreOffice, "
            "save it as .docx, and drop it again.",
        )

    try:
        with zipfile.ZipFile(io.BytesIO(data)) as zf:
            unpacked = sum(info.file_size for info in zf.infolist())
    except Exception as exc:
        raise fail(
            "unreadable", f"{label} could not be read as a Word document: {_reason_of(exc)}."
        ) from None
    limit = 16 * max_bytes
    if unpacked > limit:
        raise fail(
            "too_large",
            f"{label} unpacks to {_size(unpacked)}; the limit is {_size(limit)}. "
            "Split it into smaller documents.",
        )

    try:
        document = docx.Document(io.BytesIO(data))
        lines = list(_docx_blocks(document))
    except Exception as exc:
        raise fail(
            "unreadable", f"{label} could not be read as a Word document: {_reason_of(exc)}."
        ) from None
    return "\n\n".join(line for line in lines if line.strip())


def _docx_blocks(container):
    """Paragraphs and tables of a document or table cell, in document order, as text blocks."""
    from docx.table import Table
    from docx.text.paragraph import Paragraph

    for block in container.iter_inner_content():
        if isinstance(block, Paragraph):
            text = block.text
            if not text.strip():
                continue
            level = _heading_level(block)
            yield ("#" * level + " " + text.strip()) if level else text
        elif isinstance(block, Table):
            yield _docx_table(block)


def _heading_level(paragraph) -> int:
    try:
        style = paragraph.style
        name = (style.name or "") if style is not None else ""
    except Exception:
        return 0
    lowered = name.lower()
    if lowered == "title":
        return 1
    match = re.fullmatch(r"heading ([1-6])", lowered)
    return int(match.group(1)) if match else 0


def _docx_table(table) -> str:
    rows: list[str] = []
    for row in table.rows:
        cells: list[str] = []
        previous = None
        for cell in row.cells:
            if previous is not None and cell._tc is previous:  # horizontally merged: same cell repeated
                continue
            previous = cell._tc
            text = "\n".join(_docx_blocks(cell))
            text = re.sub(r"\s*\n\s*", " ", text).strip().replace("|", "\\|")
            cells.append(text)
        if any(cells):
            rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)
