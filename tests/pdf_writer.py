"""A minimal PDF writer for test fixtures: Helvetica text content streams, one per page, a correct xref."""

from __future__ import annotations


def _pdf_string(s: str) -> str:
    return s.replace("\\", "\\\\").replace("(", "\\(").replace(")", "\\)")


def make_pdf(pages: list[list[str] | None], damaged: tuple[int, ...] = ()) -> bytes:
    """A valid PDF; each page is a list of ASCII lines, or None for a page with only a grey box. The pages numbered
    in `damaged` (from 1) have a compressed content stream whose bytes are not what they were (a damaged file)."""
    objs: dict[int, bytes] = {
        1: b"<< /Type /Catalog /Pages 2 0 R >>",
        3: b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica /Encoding /WinAnsiEncoding >>",
    }
    kids = []
    next_id = 4
    for lines in pages:
        page_id, content_id = next_id, next_id + 1
        next_id += 2
        kids.append(page_id)
        if lines is None:  # what a scanned page looks like to a text extractor: drawing, no text
            stream = b"q 0.5 g 72 72 468 648 re f Q\n"
        else:
            ops = ["BT", "/F1 9 Tf", "11 TL", "50 770 Td"]
            ops += [f"({_pdf_string(line)}) Tj T*" for line in lines]
            ops.append("ET")
            stream = ("\n".join(ops) + "\n").encode("latin-1")
        objs[page_id] = (
            "<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] "
            f"/Resources << /Font << /F1 3 0 R >> >> /Contents {content_id} 0 R >>"
        ).encode()
        if len(kids) in damaged:
            import zlib

            stream = bytearray(zlib.compress(stream))
            stream[8:40] = b"\x00" * 32
            objs[content_id] = b"<< /Length %d /Filter /FlateDecode >>\nstream\n" % len(stream) + stream + b"endstream"
        else:
            objs[content_id] = b"<< /Length %d >>\nstream\n" % len(stream) + stream + b"endstream"
    objs[2] = (
        "<< /Type /Pages /Kids [" + " ".join(f"{k} 0 R" for k in kids) + f"] /Count {len(kids)} >>"
    ).encode()

    out = bytearray(b"%PDF-1.4\n%\xe2\xe3\xcf\xd3\n")
    offsets = {}
    for i in sorted(objs):
        offsets[i] = len(out)
        out += b"%d 0 obj\n" % i + objs[i] + b"\nendobj\n"
    xref = len(out)
    size = max(objs) + 1
    out += b"xref\n0 %d\n0000000000 65535 f \n" % size
    for i in range(1, size):
        out += b"%010d 00000 n \n" % offsets[i]
    out += b"trailer\n<< /Size %d /Root 1 0 R >>\nstartxref\n%d\n%%%%EOF\n" % (size, xref)
    return bytes(out)
