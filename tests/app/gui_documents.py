"""Document fixtures made at test time from real text (Python's own pydoc topics)."""

from __future__ import annotations

import textwrap
from pathlib import Path
from pydoc_data.topics import topics


def topic_text(name: str) -> str:
    return topics[name]


def write_markdown(path: Path, topic: str = "with") -> tuple[Path, str]:
    text = f"# The {topic} statement\n\n" + topic_text(topic)
    path.write_text(text, encoding="utf-8")
    return path, next(line.strip() for line in topic_text(topic).split("\n") if len(line.strip()) > 30)


def write_docx(path: Path, topic: str = "for") -> tuple[Path, str]:
    import docx

    document = docx.Document()
    document.add_heading(f"The {topic} statement", level=1)
    for paragraph in topic_text(topic).split("\n\n"):
        if paragraph.strip():
            document.add_paragraph(paragraph.strip())
    document.save(str(path))
    return path, topic_text(topic).split("\n\n")[1].strip().split("\n")[0]


def write_pdf(path: Path, topic: str = "while") -> tuple[Path, str]:
    """A text PDF (Helvetica, one content stream per page), ASCII lines wrapped at 90 columns."""
    lines = []
    for paragraph in topic_text(topic).encode("ascii", "replace").decode().split("\n"):
        lines += textwrap.wrap(paragraph, 90) or [""]
    pages = [lines[i:i + 60] for i in range(0, len(lines), 60)]
    path.write_bytes(_pdf(pages))
    first = next(line for line in lines if len(line) > 30)
    return path, first


def _escape(line: str) -> str:
    return line.replace("\\", "\\\\").replace("(", "\\(").replace(")", "\\)")


def _pdf(pages: list[list[str]]) -> bytes:
    objects = {1: b"<< /Type /Catalog /Pages 2 0 R >>",
               3: b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica /Encoding /WinAnsiEncoding >>"}
    kids, next_id = [], 4
    for lines in pages:
        page, content = next_id, next_id + 1
        next_id += 2
        kids.append(page)
        ops = ["BT", "/F1 9 Tf", "11 TL", "40 760 Td"] + [f"({_escape(line)}) Tj T*" for line in lines] + ["ET"]
        stream = ("\n".join(ops) + "\n").encode("latin-1")
        objects[page] = (f"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Resources << /Font << /F1 3 0 R >> >>"
                         f" /Contents {content} 0 R >>").encode()
        objects[content] = b"<< /Length %d >>\nstream\n" % len(stream) + stream + b"endstream"
    objects[2] = ("<< /Type /Pages /Kids [" + " ".join(f"{k} 0 R" for k in kids) + f"] /Count {len(kids)} >>").encode()
    out = bytearray(b"%PDF-1.4\n")
    offsets = {}
    for number in sorted(objects):
        offsets[number] = len(out)
        out += b"%d 0 obj\n" % number + objects[number] + b"\nendobj\n"
    xref = len(out)
    size = max(objects) + 1
    out += b"xref\n0 %d\n0000000000 65535 f \n" % size
    for number in range(1, size):
        out += b"%010d 00000 n \n" % offsets[number]
    out += b"trailer\n<< /Size %d /Root 1 0 R >>\nstartxref\n%d\n%%%%EOF\n" % (size, xref)
    return bytes(out)


def write_encrypted_pdf(path: Path) -> Path:
    from pypdf import PdfReader, PdfWriter

    plain = path.with_name("plain-" + path.name)
    write_pdf(plain)
    writer = PdfWriter()
    for page in PdfReader(str(plain)).pages:
        writer.add_page(page)
    writer.encrypt(user_password="secret", owner_password="owner", algorithm="RC4-128")
    with open(path, "wb") as fh:
        writer.write(fh)
    return path
