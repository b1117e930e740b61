"""PDF: the text layer of every page read with pypdf, with encrypted, damaged and scanned (image-only) files
refused with a message that says what to do; spacing and presentation forms of the text layer are tidied."""

from __future__ import annotations

import io
import logging
import re
import unicodedata

from .core import _reason_of

# pypdf logs what it repairs in a damaged file ("EOF marker not found") as warnings, which reached the terminal
# chat before our own message; a file it cannot read raises, and our message says what to do
logging.getLogger("pypdf").setLevel(logging.ERROR)


def _scanned_message(label: str) -> str:
    return (
        f"{label} has no extractable text; it looks like a scanned document (pages stored as images). "
        "Run OCR on it first (for example with OCRmyPDF or Adobe Acrobat) and drop the result."
    )


_PDF_SPACING = re.compile(r"[ \t\u00a0\u2000-\u200a\u202f\u205f\u3000]+")


# Presentation forms a PDF's text layer uses for what is plain text: ligatures (ﬁ ﬂ ﬀ, LaTeX and Qt
# write them) and the Kangxi / CJK radicals Qt's writer maps ideographs such as 户 and 目 to.
_PDF_COMPAT = re.compile("[\ufb00-\ufb06\u2e80-\u2ef3\u2f00-\u2fd5]")
# Kangxi radicals whose NFKC form is the traditional character where simplified Chinese writes another: a writer
# that mapped 户 to the radical ⼾ (Qt's, with a simplified-Chinese font) means 户 in a simplified text
_SIMPLIFIED_RADICALS = {"\u2f3e": "\u6237"}  # ⼾ -> 户 (NFKC gives 戶)
# Characters only simplified Chinese writes (their traditional forms differ): a text with any is simplified
_SIMPLIFIED_ONLY = re.compile("[这们个为说时国会来对学发经过动后没现开关问题样长门见让还应间实]")

# C0 controls in extracted text are glyphs the PDF gives no character for (its ToUnicode map omits them)
# (and a UTF-16 surrogate alone: a broken font map's half of a character, no character at all)
_PDF_UNMAPPED = re.compile("[\x01-\x08\x0b\x0c\x0e-\x1f\x7f\ud800-\udfff]")


def _clean_pdf_text(text: str, notes: list[str]) -> str:
    """Ligatures and radicals become the characters they stand for (NFKC, for those alone); glyphs the PDF
    maps to no character become U+FFFD, and a note says how many (the model must not read them as text)."""
    simplified = _SIMPLIFIED_ONLY.search(text) is not None
    text = _PDF_COMPAT.sub(lambda m: (_SIMPLIFIED_RADICALS.get(m.group()) if simplified else None)
                           or unicodedata.normalize("NFKC", m.group()), text)
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


def _damaged(page) -> bool:
    """Whether a page that gave no text has a content stream that holds bytes but decodes to nothing: pypdf logs the
    decompression error and reads the page as blank, where a blank page has no such stream."""
    try:
        from pypdf.generic import ArrayObject

        contents = page.get("/Contents")
        if contents is None:
            return False
        contents = contents.get_object()
        for stream in (contents if isinstance(contents, ArrayObject) else [contents]):
            stream = stream.get_object()
            # the raw bytes as read (pypdf keeps them in _data and drops /Length once it has read the stream)
            if getattr(stream, "_data", b"") and not stream.get_data():
                return True
    except Exception:  # noqa: BLE001 - a stream that fails to decode at all is damaged too
        return True
    return False


def _pdf_text(data: bytes, label: str, fail, max_chars: int, notes: list[str] | None = None) -> tuple[str, int]:
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

    # A PDF ends with %%EOF (within its last kilobyte; some writers add a little after it): without it the file
    # was most likely cut short (an interrupted download or copy), which is what a user can fix
    cut = "" if b"%%EOF" in data[-1024:] else (
        " It looks incomplete (it does not end as a PDF does): download or copy it again.")
    try:
        reader = PdfReader(io.BytesIO(data), strict=False)
    except Exception as exc:
        raise fail("unreadable", f"{label} could not be read as a PDF: {_reason_of(exc)}.{cut}") from None

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
        raise fail("unreadable", f"{label} could not be read as a PDF: {_reason_of(exc)}.{cut}") from None
    if n_pages == 0:
        raise fail("unreadable", f"{label} could not be read as a PDF: it has no pages.")

    parts: list[str] = []
    total = 0
    failures: list[tuple[int, BaseException | None]] = []  # (page, why; None: its content did not decompress)
    for index in range(n_pages):
        try:
            page_text = (page_list[index].extract_text() or "").strip("\n")
            failed = None if page_text.strip() or not _damaged(page_list[index]) else (index + 1, None)
        except Exception as exc:  # a damaged page: mark it, keep the rest
            if encrypted and isinstance(exc, DependencyError):  # AES streams, no crypto library
                raise fail("encrypted", aes_message) from None
            failed = (index + 1, exc)
        if failed is not None:
            failures.append(failed)
            parts.append(f"[page {index + 1}: text could not be extracted]")
            continue
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
    damaged = "its content is damaged (it could not be decompressed)"
    if failures and len(failures) == n_pages:
        page, exc = failures[0]
        raise fail("unreadable", f"{label} could not be read as a PDF: page {page}: "
                   f"{damaged if exc is None else _reason_of(exc)}. Download or export it again.")
    if failures and notes is not None:
        pages = ", ".join(str(page) for page, _ in failures[:10]) + (", ..." if len(failures) > 10 else "")
        several = len(failures) > 1
        notes.append(f"Page{'s' if several else ''} {pages} of this PDF could not be read (damaged): the model does "
                     f"not see {'their' if several else 'its'} text. Download or export the PDF again.")
    return "\n\n".join(parts), n_pages

