"""What a file really is, from its first bytes: a file's name often lies (a PDF a browser saved as "report" or
"report.txt", a .docx renamed .pdf, a photo with no suffix), so ``identify`` reads the content's signature.

Only signatures that cannot be text are trusted: a PDF needs its ``%PDF-1.x`` header within the first kilobyte
(where PDF readers look for it) and a PDF's structure too (an ``N 0 obj`` after the header, or ``%%EOF`` near the
end), so a text that merely mentions ``%PDF-`` stays text; a Word file is a zip holding ``word/document.xml``.
Everything else named here (legacy Office files, other zips, images, programs, archives, media) is a kind of file
the readers refuse, named so the user's message says what the file is and what to do with it.
"""

from __future__ import annotations

import io
import re
import struct
import zipfile
from dataclasses import dataclass


@dataclass(frozen=True)
class Found:
    """What the content is: ``reader`` "pdf" or "docx" when a reader reads it, None for a kind refused."""

    reader: str | None
    what: str  # "a PDF file", "a legacy Word .doc file", "a PNG image"
    advice: str = ""  # what the user can do instead (one sentence), for a kind refused
    suffixes: tuple[str, ...] = ()  # the suffixes such a file has: a name that has one of them does not lie
    reason: str = "unsupported"  # the DocumentError reason for a kind refused ("encrypted": a password)
    text: bool = False  # the signature is text (RTF): a file named as text is read as the text it is


PDF = Found("pdf", "a PDF file", suffixes=(".pdf",))
DOCX = Found("docx", "a Word document", suffixes=(".docx", ".docm", ".dotx", ".dotm"))

_PDF_HEADER = re.compile(rb"%PDF-\d\.\d")
_PDF_OBJECT = re.compile(rb"\d+[ \t\r\n\f\x00]+\d+[ \t\r\n\f\x00]+obj\b")
_OLE_MAGIC = b"\xd0\xcf\x11\xe0\xa1\xb1\x1a\xe1"
_ZIP_MAGIC = (b"PK\x03\x04", b"PK\x05\x06")

_IMAGE = "Only documents' text is read: drop the document as PDF or text instead."
_PROGRAM = "It is not a document: drop a PDF, Word or text file instead."
_ARCHIVE = "Unpack it and drop the files inside instead."
_MEDIA = "Only documents' text is read: drop a transcript (.txt) instead."
_SHEET = "Spreadsheets are not supported; export the sheet as .csv and drop that instead."
_SLIDES = "Presentations are not supported; export it as PDF and drop that instead."

# (signature at offset 0, what, advice, suffixes): signatures that hold a control byte or a NUL, or an exact
# sequence no text begins with
_MAGIC = (
    (b"\x89PNG\r\n\x1a\n", "a PNG image", _IMAGE, (".png",)),
    (b"\xff\xd8\xff", "a JPEG image", _IMAGE, (".jpg", ".jpeg", ".jfif")),
    (b"GIF87a", "a GIF image", _IMAGE, (".gif",)),
    (b"GIF89a", "a GIF image", _IMAGE, (".gif",)),
    (b"II*\x00", "a TIFF image", _IMAGE, (".tif", ".tiff", ".dng", ".nef", ".cr2")),
    (b"MM\x00*", "a TIFF image", _IMAGE, (".tif", ".tiff")),
    (b"\x7fELF", "a Linux program", _PROGRAM, (".so", ".o", ".bin", ".elf")),
    (b"\xcf\xfa\xed\xfe", "a macOS program", _PROGRAM, (".dylib", ".bundle")),
    (b"\xce\xfa\xed\xfe", "a macOS program", _PROGRAM, (".dylib", ".bundle")),
    (b"\xca\xfe\xba\xbe", "a compiled program (macOS or Java)", _PROGRAM, (".class", ".dylib")),
    (b"\x1f\x8b", "a gzip archive", _ARCHIVE, (".gz", ".tgz")),
    (b"7z\xbc\xaf\x27\x1c", "a 7-Zip archive", _ARCHIVE, (".7z",)),
    (b"Rar!\x1a\x07", "a RAR archive", _ARCHIVE, (".rar",)),
    (b"\xfd7zXZ\x00", "an xz archive", _ARCHIVE, (".xz", ".txz")),
    (b"\x28\xb5\x2f\xfd", "a Zstandard archive", _ARCHIVE, (".zst",)),
    (b"SQLite format 3\x00", "an SQLite database",
     "Export the table you mean as .csv and drop that instead.", (".sqlite", ".sqlite3", ".db")),
    (b"OggS\x00", "an Ogg audio or video file", _MEDIA, (".ogg", ".oga", ".ogv", ".opus")),
    (b"fLaC\x00", "a FLAC audio file", _MEDIA, (".flac",)),
    (b"fLaC\x80", "a FLAC audio file", _MEDIA, (".flac",)),
    (b"\x1aE\xdf\xa3", "a Matroska or WebM video", _MEDIA, (".mkv", ".webm", ".mka")),
)
_RTF = Found(None, "an RTF document", "Save it as .docx or plain text (.txt) and drop that instead.", (".rtf",),
             text=True)


def identify(data: bytes) -> Found | None:
    """What ``data`` is by its signature, or None when no signature is certain (text, or something unknown).

    Signatures at the very start come first: a zip whose first entry is a PDF stored as it is is a zip."""
    if data.startswith(b"%PDF-"):
        return PDF if _is_pdf(data) else None
    if data.startswith(_ZIP_MAGIC):
        return _zip_kind(data)
    if data.startswith(_OLE_MAGIC):
        return _ole_kind(data)
    if data.startswith(b"{\\rtf"):
        return _RTF
    for magic, what, advice, suffixes in _MAGIC:
        if data.startswith(magic):
            return Found(None, what, advice, suffixes)
    head = data[:16]
    if head[:4] == b"RIFF" and head[8:12] in _RIFF:
        return Found(None, *_RIFF[head[8:12]])
    if head[4:8] == b"ftyp" and b"\x00" in head[:4]:  # ISO media: MP4, MOV, M4A, HEIC
        brand = head[8:12]
        if brand in (b"heic", b"heix", b"mif1", b"msf1", b"avif"):
            return Found(None, "a HEIC or AVIF photo", _IMAGE, (".heic", ".heif", ".avif"))
        return Found(None, "a video or audio file (MP4)", _MEDIA, (".mp4", ".m4a", ".m4v", ".mov", ".3gp"))
    if head[:3] == b"ID3" and head[3:4] in (b"\x02", b"\x03", b"\x04") and head[4:5] == b"\x00":
        return Found(None, "an MP3 audio file", _MEDIA, (".mp3",))
    if head[:2] == b"MZ" and b"\x00" in data[2:64]:  # a DOS header is mostly NULs; a text starting "MZ" has none
        return Found(None, "a Windows program", _PROGRAM, (".exe", ".dll", ".sys", ".msi", ".scr", ".com"))
    return PDF if _is_pdf(data) else None  # a PDF may follow a few bytes of something else (a mail header, say)


_RIFF = {
    b"WEBP": ("a WebP image", _IMAGE, (".webp",)),
    b"WAVE": ("a WAV audio file", _MEDIA, (".wav",)),
    b"AVI ": ("an AVI video", _MEDIA, (".avi",)),
}


def _is_pdf(data: bytes) -> bool:
    header = _PDF_HEADER.search(data, 0, 1024 + 8)
    if header is None or header.start() >= 1024:
        return False
    return b"%%EOF" in data[-1024:] or _PDF_OBJECT.search(data, header.end(), header.end() + 65536) is not None


def _zip_kind(data: bytes) -> Found:
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as zf:
            names = set(zf.namelist())
    except Exception:  # a damaged zip (cut short): its entries' names are still in their local headers
        names = set()
        for header in re.finditer(rb"PK\x03\x04", data[:1 << 20]):
            start = header.start() + 30
            if start > len(data):
                break
            (length,) = struct.unpack_from("<H", data, header.start() + 26)
            names.add(data[start:start + length].decode("latin-1"))
    if "word/document.xml" in names:
        return DOCX
    if "xl/workbook.xml" in names:
        return Found(None, "an Excel .xlsx spreadsheet", _SHEET, (".xlsx", ".xlsm"))
    if "ppt/presentation.xml" in names:
        return Found(None, "a PowerPoint .pptx presentation", _SLIDES, (".pptx", ".ppsx"))
    mimetype = data[38:100] if data[30:38] == b"mimetype" else b""  # ODF and EPUB store it first, uncompressed
    if mimetype.startswith(b"application/vnd.oasis.opendocument.text"):
        return Found(None, "an OpenDocument .odt text",
                     "Save it as .docx (File > Save As > Word) and drop that instead.", (".odt",))
    if mimetype.startswith(b"application/vnd.oasis.opendocument.spreadsheet"):
        return Found(None, "an OpenDocument .ods spreadsheet", _SHEET, (".ods",))
    if mimetype.startswith(b"application/vnd.oasis.opendocument.presentation"):
        return Found(None, "an OpenDocument .odp presentation", _SLIDES, (".odp",))
    if mimetype.startswith(b"application/epub+zip"):
        return Found(None, "an EPUB e-book", "E-books are not supported; convert it to PDF or plain text first.",
                     (".epub",))
    if "index.xml" in names and any(n.startswith("Data/") or n.startswith("QuickLook/") for n in names):
        return Found(None, "an Apple Pages document", "Export it as .docx or PDF and drop that instead.",
                     (".pages", ".numbers", ".key"))
    return Found(None, "a zip archive", _ARCHIVE, (".zip", ".jar", ".apk", ".pages", ".numbers", ".key"))


def _ole_kind(data: bytes) -> Found:
    """A legacy Office (OLE2 compound) file; its streams' names (UTF-16 in its directory) say which program."""

    def has(stream: str) -> bool:
        return stream.encode("utf-16-le") in data

    if has("EncryptedPackage"):
        return Found(None, "a password-protected Office document",
                     "Open it in Office, remove the password (File > Info > Protect), save it, and drop it again.",
                     (".docx", ".xlsx", ".pptx"), reason="encrypted")
    if has("WordDocument"):
        return Found(None, "a legacy Word .doc file",
                     "Open it in Word or LibreOffice, save it as .docx or PDF, and drop that instead.",
                     (".doc", ".dot", ".wps"))
    if has("PowerPoint Document"):
        return Found(None, "a legacy PowerPoint .ppt presentation", _SLIDES, (".ppt", ".pps", ".pot"))
    if has("Workbook"):
        return Found(None, "a legacy Excel .xls spreadsheet", _SHEET, (".xls", ".xlt"))
    if has("__substg1.0_"):
        return Found(None, "an Outlook message", "Save it as text (.txt) or PDF and drop that instead.", (".msg",))
    return Found(None, "a legacy Microsoft Office file",
                 "Open it in the program that made it, save it as .docx or PDF, and drop that instead.",
                 (".doc", ".xls", ".ppt", ".msi", ".msg", ".pub", ".vsd"))
