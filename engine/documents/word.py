"""Word (.docx; a macro-enabled .docm and a .dotx or .dotm template too, whose macros are never run): paragraphs,
headings (as Markdown ``#``), list items (``-``) and tables (as Markdown rows) read with python-docx, in document
order, with the text of tracked insertions, content controls, hyperlinks and text boxes; the headers and footers
(once each) and the footnotes and endnotes follow the body. Old .doc files, password-protected files and zip bombs
are refused first. A Strict Open XML document is read as a .docx."""

from __future__ import annotations

import io
import re
import zipfile

from .core import _reason_of, _size
from .sniff import _OLE_MAGIC


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
            f"{label} is an old Word .doc file under a newer Word file's name. Open it in Word or LibreOffice, "
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
        data = _as_docx(data)
        document = docx.Document(io.BytesIO(data))
    except ValueError as exc:  # python-docx: "file '…' is not a Word file, content type is '…'"
        found = re.search(r"content type is '([^']*)'", str(exc))
        if found is None:
            raise fail("unreadable", f"{label} could not be read as a Word document: {_reason_of(exc)}.") from None
        raise fail("unreadable", f"{label} could not be read as a Word document: its main part has the content "
                                 f"type {found.group(1)}, not a Word document's. Open it in Word or LibreOffice, "
                                 "save it as a Word Document (.docx), and drop that instead.") from None
    except Exception as exc:
        raise fail(
            "unreadable", f"{label} could not be read as a Word document: {_reason_of(exc)}."
        ) from None
    try:
        lines = list(_docx_blocks(document.element.body, document._body))
        lines += _headers_and_footers(document)
        with zipfile.ZipFile(io.BytesIO(data)) as zf:
            lines += _notes(zf, "word/footnotes.xml", "footnote", "Footnotes")
            lines += _notes(zf, "word/endnotes.xml", "endnote", "Endnotes")
    except Exception as exc:
        raise fail(
            "unreadable", f"{label} could not be read as a Word document: {_reason_of(exc)}."
        ) from None
    return "\n\n".join(line for line in lines if line.strip())


_W = "{http://schemas.openxmlformats.org/wordprocessingml/2006/main}"

# The main part's content type in Word's other packages: a macro-enabled document (.docm), a template (.dotx) and a
# macro-enabled template (.dotm). python-docx opens only a .docx's ("is not a Word file"), but their document.xml is
# the same WordprocessingML; read with a .docx's type, their text is read and their macros (vbaProject.bin) never run.
_WORD_MAIN_TYPES = (b"application/vnd.ms-word.document.macroEnabled.main+xml",
                    b"application/vnd.openxmlformats-officedocument.wordprocessingml.template.main+xml",
                    b"application/vnd.ms-word.template.macroEnabledTemplate.main+xml")
_DOCX_MAIN_TYPE = b"application/vnd.openxmlformats-officedocument.wordprocessingml.document.main+xml"
_CONTENT_TYPES = "[Content_Types].xml"


# Word's "Strict Open XML Document" (.docx too) names every namespace and relationship type under
# http://purl.oclc.org/ooxml/ where a .docx has http://schemas.openxmlformats.org/<part>/2006/ (ECMA-376 Part 1
# against Part 4); python-docx knows only the latter ("no relationship of type ...officeDocument"). The elements are
# the same, so the package is read with the transitional names.
_STRICT = re.compile(rb"http://purl\.oclc\.org/ooxml/([A-Za-z]+)/([A-Za-z]+)")
_STRICT_RENAMED = {b"extendedProperties": b"extended-properties", b"customProperties": b"custom-properties"}


def _transitional(xml: bytes) -> bytes:
    """An XML part of a Strict package with the transitional namespaces and relationship types."""
    return _STRICT.sub(lambda m: b"http://schemas.openxmlformats.org/%s/2006/%s"
                       % (m.group(1), _STRICT_RENAMED.get(m.group(2), m.group(2))), xml)


def _as_docx(data: bytes) -> bytes:
    """The package `data` as python-docx reads it: a .docx's main content type where it has another Word package's,
    the transitional names where it is Strict Open XML; as it is else."""
    with zipfile.ZipFile(io.BytesIO(data)) as zf:
        try:
            types = zf.read(_CONTENT_TYPES)
        except KeyError:
            return data  # python-docx says what is missing
        fixed = types
        for other in _WORD_MAIN_TYPES:
            fixed = fixed.replace(other, _DOCX_MAIN_TYPE)
        try:
            strict = b"http://purl.oclc.org/ooxml/" in zf.read("_rels/.rels")
        except KeyError:
            strict = False
        if fixed == types and not strict:
            return data
        out = io.BytesIO()
        with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as package:  # stored: python-docx unpacks it all anyway
            for info in zf.infolist():
                part = fixed if info.filename == _CONTENT_TYPES else zf.read(info)
                if strict and info.filename.endswith((".xml", ".rels")):
                    part = _transitional(part)
                package.writestr(info.filename, part)
    return out.getvalue()


def _docx_blocks(element, parent):
    """Paragraphs and tables of a body, table cell, header or content control (XML element; `parent` the
    python-docx object it belongs to, whose part has the styles), in document order, as text blocks."""
    from docx.table import Table
    from docx.text.paragraph import Paragraph

    for child in element.iterchildren():
        if child.tag == _W + "p":
            paragraph = Paragraph(child, parent)
            text = _paragraph_text(child)
            if not text.strip():
                continue
            level = _heading_level(paragraph)
            if level:
                yield "#" * level + " " + text.strip()
            elif child.find(f"{_W}pPr/{_W}numPr") is not None or _style_name(paragraph).startswith("list"):
                yield "- " + text.strip()  # a list item (bulleted or numbered)
            else:
                yield text
        elif child.tag == _W + "tbl":
            yield _docx_table(Table(child, parent))
        elif child.tag == _W + "sdt":  # a content control around blocks (a cover page, a form field)
            content = child.find(_W + "sdtContent")
            if content is not None:
                yield from _docx_blocks(content, parent)


def _paragraph_text(p) -> str:
    """A paragraph's text as Word shows it: every run's text, inside tracked insertions, hyperlinks, fields and
    content controls too (deleted text is w:delText, so it is left out)."""
    parts = []
    for node in p.iter(_W + "t", _W + "tab", _W + "br", _W + "cr"):
        if node.tag == _W + "t":
            parts.append(node.text or "")
        elif node.tag == _W + "tab":
            parts.append("\t")
        else:
            parts.append("\n")
    return "".join(parts)


def _headers_and_footers(document) -> list[str]:
    """Each distinct header and footer text once (sections that link to the previous one repeat it)."""
    seen: list[str] = []
    for section in document.sections:
        for part in (section.header, section.first_page_header, section.footer, section.first_page_footer):
            try:
                if part.is_linked_to_previous:
                    continue
                text = "\n".join(_docx_blocks(part._element, part)).strip()
            except Exception:  # noqa: BLE001 - a damaged header is left out, the body is what matters
                continue
            if text and text not in seen:
                seen.append(text)
    return seen


def _notes(zf: zipfile.ZipFile, name: str, tag: str, title: str) -> list[str]:
    """The footnotes or endnotes part's notes as "[n] text" lines under a title (the separators, ids -1 and 0,
    left out)."""
    try:
        raw = zf.read(name)
    except KeyError:
        return []
    from lxml import etree

    root = etree.fromstring(raw)
    notes = []
    for note in root.iter(_W + tag):
        ident = note.get(_W + "id")
        if ident is None or not ident.lstrip("-").isdigit() or int(ident) <= 0:
            continue
        text = " ".join(_paragraph_text(p).strip() for p in note.iter(_W + "p")).strip()
        if text:
            notes.append(f"[{ident}] {text}")
    return [f"{title}:\n" + "\n".join(notes)] if notes else []


def _style_name(paragraph) -> str:
    try:
        style = paragraph.style
        return (style.name or "").lower() if style is not None else ""
    except Exception:  # noqa: BLE001 - no styles part (a paragraph outside the document body)
        return ""


def _heading_level(paragraph) -> int:
    lowered = _style_name(paragraph)
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
            text = "\n".join(_docx_blocks(cell._tc, cell))
            text = re.sub(r"\s*\n\s*", " ", text).strip().replace("|", "\\|")
            cells.append(text)
        if any(cells):
            rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)
