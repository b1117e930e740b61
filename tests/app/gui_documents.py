"""Document fixtures made at test time from real text (Python's own pydoc topics)."""

from __future__ import annotations

import textwrap
from pathlib import Path
from pydoc_data.topics import topics

from tests.pdf_writer import make_pdf


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
    path.write_bytes(make_pdf(pages))
    first = next(line for line in lines if len(line) > 30)
    return path, first


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
