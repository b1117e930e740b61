"""Word (.docx): paragraphs, headings (as Markdown ``#``) and tables (as Markdown rows) read with python-docx,
in document order; old .doc files, password-protected files and zip bombs are refused first."""

from __future__ import annotations

import io
import re
import zipfile

from .core import _reason_of, _size

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
