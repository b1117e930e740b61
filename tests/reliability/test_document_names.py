"""Files whose name lies about their content: a PDF a browser saved as "report" or "report.txt", a .docx renamed
.pdf, a photo without a suffix. ``load_document`` reads by the content's signature where it is unambiguous, says so
in the document's notes, and names what a file it cannot read really is.

PDFs come from the minimal writer in tests/pdf_writer.py (as in tests/engine/test_documents.py), .docx files
from python-docx, other Office files and images from their real signatures.
"""

from __future__ import annotations

import io
import os
import random
import zipfile
from pydoc_data.topics import topics

import pytest

from engine.documents import DocumentError, is_supported, load_document
from tests.pdf_writer import make_pdf

LINES = [line for line in topics["while"].splitlines() if line.isascii() and line.strip()][:40]
SNIPPET = LINES[2].strip()
OLE = b"\xd0\xcf\x11\xe0\xa1\xb1\x1a\xe1"


@pytest.fixture(scope="module")
def pdf() -> bytes:
    return make_pdf([LINES])


@pytest.fixture(scope="module")
def word(tmp_path_factory) -> bytes:
    import docx

    path = tmp_path_factory.mktemp("word") / "memo.docx"
    d = docx.Document()
    d.add_heading("Quarterly memo", level=1)
    d.add_paragraph("The harbour handled 12,000 tonnes in March.")
    d.save(str(path))
    return path.read_bytes()


def write(tmp_path, name: str, data: bytes):
    path = tmp_path / name
    path.write_bytes(data)
    return path


def refused(path) -> DocumentError:
    with pytest.raises(DocumentError) as exc_info:
        load_document(path)
    assert os.path.basename(path) in str(exc_info.value)
    return exc_info.value


# --------------------------------------------------------------------------------------------------
# The content wins: PDF and Word files under another name
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["report.txt", "report", "report.docx", "report.dat", "README"])
def test_a_pdf_under_another_name_is_read_as_a_pdf(tmp_path, pdf, name):
    # A text suffix decoded it as garbage, .docx called it a damaged Word file, no suffix refused it
    doc = load_document(write(tmp_path, name, pdf))
    assert doc.kind == "pdf" and doc.pages == 1 and doc.name == name
    assert SNIPPET in doc.text
    assert doc.notes == (f'"{name}" is a PDF file; read as PDF.',)


def test_a_pdf_after_a_few_bytes_of_something_else_is_a_pdf_within_the_first_kilobyte(tmp_path, pdf):
    # PDF readers look for the header in the first 1024 bytes (a mail or download header may come first)
    doc = load_document(write(tmp_path, "saved.txt", b"Content-Type: application/pdf\r\n\r\n" + pdf))
    assert doc.kind == "pdf" and SNIPPET in doc.text
    late = load_document(write(tmp_path, "late.txt", b"x" * 1100 + pdf))
    assert late.kind == "text" and not any("PDF" in note for note in late.notes)  # past it: what its name says


@pytest.mark.parametrize("name", ["memo.pdf", "memo.txt", "memo"])
def test_a_word_file_under_another_name_is_read_as_word(tmp_path, word, name):
    doc = load_document(write(tmp_path, name, word))
    assert doc.kind == "docx"
    assert doc.text.startswith("# Quarterly memo") and "12,000 tonnes" in doc.text
    assert doc.notes == (f'"{name}" is a Word document; read as Word.',)


DOCX_MAIN = "application/vnd.openxmlformats-officedocument.wordprocessingml.document.main+xml"
MACRO_MAIN = "application/vnd.ms-word.document.macroEnabled.main+xml"


def _repackaged(word: bytes, main_type: str, *, macros: bool = False) -> bytes:
    """`word` with its main part's content type in [Content_Types].xml replaced (as Word writes a .docm or a
    template), and a macro project when `macros`."""
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(word)) as zin, zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as zout:
        for info in zin.infolist():
            data = zin.read(info)
            if info.filename == "[Content_Types].xml":
                assert DOCX_MAIN.encode() in data
                data = data.replace(DOCX_MAIN.encode(), main_type.encode())
            zout.writestr(info.filename, data)
        if macros:
            zout.writestr("word/vbaProject.bin", OLE + bytes(504))
    return out.getvalue()


WORD_PACKAGES = [
    ("memo.docm", MACRO_MAIN, True),
    ("memo.docx", MACRO_MAIN, True),  # a .docm renamed .docx: python-docx refused it by its content type
    ("letter.dotx", "application/vnd.openxmlformats-officedocument.wordprocessingml.template.main+xml", False),
    ("letter.dotm", "application/vnd.ms-word.template.macroEnabledTemplate.main+xml", True),
]


@pytest.mark.parametrize(("name", "main_type", "macros"), WORD_PACKAGES, ids=[case[0] for case in WORD_PACKAGES])
def test_a_macro_enabled_word_file_or_a_template_is_read_as_word(tmp_path, word, name, main_type, macros):
    # python-docx refuses them ("is not a Word file, content type is ..."); their document.xml is the same
    import docx

    data = _repackaged(word, main_type, macros=macros)
    with pytest.raises(ValueError, match="is not a Word file"):
        docx.Document(io.BytesIO(data))
    doc = load_document(write(tmp_path, name, data))
    assert doc.kind == "docx" and doc.notes == () and is_supported(name)
    assert doc.text.startswith("# Quarterly memo") and "12,000 tonnes" in doc.text
    renamed = load_document(write(tmp_path, "memo.pdf", data))
    assert renamed.kind == "docx" and renamed.notes == ('"memo.pdf" is a Word document; read as Word.',)


def _strict(word: bytes) -> bytes:
    """`word` as Word saves it as a "Strict Open XML Document": every namespace and relationship type of its
    markup under http://purl.oclc.org/ooxml/ (the package's own, package/2006 and markup-compatibility, stay)."""
    import re

    def to_strict(m):
        name = {b"extended-properties": b"extendedProperties", b"custom-properties": b"customProperties"}
        return b"http://purl.oclc.org/ooxml/%s/%s" % (m.group(1), name.get(m.group(2), m.group(2)))

    markup = re.compile(rb"http://schemas\.openxmlformats\.org/(officeDocument|wordprocessingml|drawingml)/2006/"
                        rb"([A-Za-z-]+)")
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(word)) as zin, zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as zout:
        for info in zin.infolist():
            data = zin.read(info)
            if info.filename.endswith((".xml", ".rels")):
                data = markup.sub(to_strict, data)
            if info.filename == "word/document.xml":
                data = data.replace(b"<w:document ", b'<w:document w:conformance="strict" ', 1)
            zout.writestr(info.filename, data)
    return out.getvalue()


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> bytes:
    """A .docx with a heading, a list, a table and a header."""
    import docx

    path = tmp_path_factory.mktemp("report") / "report.docx"
    d = docx.Document()
    d.sections[0].header.paragraphs[0].text = "Harbour board, internal"
    d.add_heading("Quarterly memo", level=1)
    d.add_paragraph("The harbour handled 12,000 tonnes in March.")
    d.add_paragraph("Crane 4 is back in service.", style="List Bullet")
    table = d.add_table(rows=2, cols=2)
    for (row, col), text in {(0, 0): "Month", (0, 1): "Tonnes", (1, 0): "March", (1, 1): "12,000"}.items():
        table.cell(row, col).text = text
    d.save(str(path))
    return path.read_bytes()


@pytest.mark.parametrize("name", ["report.docx", "report.pdf"])
def test_a_strict_open_xml_word_document_is_read_as_its_transitional_twin(tmp_path, report, name):
    # python-docx knows only the transitional names: it refused Word's "Strict Open XML Document" outright
    import docx

    strict = _strict(report)
    with zipfile.ZipFile(io.BytesIO(strict)) as zf:
        assert b"purl.oclc.org/ooxml/officeDocument/relationships/officeDocument" in zf.read("_rels/.rels")
        assert b"schemas.openxmlformats.org/wordprocessingml" not in zf.read("word/document.xml")
    with pytest.raises(KeyError, match="officeDocument"):
        docx.Document(io.BytesIO(strict))
    twin = load_document(write(tmp_path, "twin.docx", report))
    doc = load_document(write(tmp_path, name, strict))
    assert doc.kind == "docx" and doc.text == twin.text
    assert doc.text.startswith("# Quarterly memo") and "- Crane 4 is back in service." in doc.text
    assert "| March | 12,000 |" in doc.text and "Harbour board, internal" in doc.text
    assert doc.notes == (() if name.endswith(".docx") else (f'"{name}" is a Word document; read as Word.',))


def test_a_word_package_whose_main_part_is_no_document_says_what_to_do(tmp_path, word):
    err = refused(write(tmp_path, "odd.docx", _repackaged(word, "application/xml")))
    assert err.reason == "unreadable" and str(err) == (
        '"odd.docx" could not be read as a Word document: its main part has the content type application/xml, not a '
        "Word document's. Open it in Word or LibreOffice, save it as a Word Document (.docx), and drop that instead.")


def test_content_that_matches_its_name_gets_no_note(tmp_path, pdf, word):
    assert load_document(write(tmp_path, "report.pdf", pdf)).notes == ()
    assert load_document(write(tmp_path, "memo.docx", word)).notes == ()
    assert load_document(write(tmp_path, "notes.txt", b"Plain notes.\n")).notes == ()


def test_a_pdf_cut_short_under_a_text_name_says_it_is_an_incomplete_pdf(tmp_path, pdf):
    err = refused(write(tmp_path, "download.txt", pdf[: len(pdf) // 2]))
    assert err.reason == "unreadable"
    assert '"download.txt" (a PDF file) could not be read as a PDF' in str(err)
    assert "download or copy it again" in str(err)


def test_an_encrypted_pdf_without_a_suffix_says_it_is_password_protected(tmp_path, pdf):
    from pypdf import PdfReader, PdfWriter

    writer = PdfWriter(clone_from=PdfReader(io.BytesIO(pdf)))
    writer.encrypt("secret", "owner-secret", algorithm="RC4-128")
    out = io.BytesIO()
    writer.write(out)
    err = refused(write(tmp_path, "statement", out.getvalue()))
    assert err.reason == "encrypted" and '"statement" (a PDF file) is password-protected' in str(err)


# --------------------------------------------------------------------------------------------------
# Text that only mentions a PDF stays text
# --------------------------------------------------------------------------------------------------


def test_a_text_that_mentions_a_pdf_header_stays_text(tmp_path):
    body = ("Notes on file formats.\nA PDF begins with a header line.\nThe header reads %PDF-1.7 and objects follow,"
            " written as 1 0 obj ... endobj.\nThe last line of a PDF is %%EOF\n")
    for name in ("formats.txt", "formats.md"):
        doc = load_document(write(tmp_path, name, body.encode()))
        assert doc.kind in ("text", "markdown") and doc.text == body.rstrip() and doc.notes == ()
    doc = load_document(write(tmp_path, "formats", body.encode()))
    assert doc.kind == "text" and doc.text == body.rstrip()
    legacy = "Résumé des formats.\nUn PDF commence par %PDF-1.7, puis 1 0 obj ... endobj.\n" * 3
    doc = load_document(write(tmp_path, "formats-1252.txt", legacy.encode("cp1252")))
    assert doc.kind == "text" and doc.text == legacy.rstrip()


def test_a_pdf_header_alone_is_no_pdf():
    # the header and a PDF's structure (an object, or %%EOF at the end): a text quoting the header is not one
    from engine.documents.sniff import identify

    assert identify(b"Line one.\nLine two.\nA PDF starts with %PDF-1.4 and that is all.\n") is None
    assert identify(b"%PDF-1.4\nand nothing else a PDF has") is None
    assert identify(b"%PDF-1.4\n1 0 obj\n<< >>\nendobj\n").reader == "pdf"  # cut short: still a PDF
    assert identify(b"From: a@b\n\n%PDF-1.4\n<< >>\n%%EOF\n").reader == "pdf"


# --------------------------------------------------------------------------------------------------
# Text under a .pdf or .docx name: a failed download's page is refused, prose is read as text
# --------------------------------------------------------------------------------------------------

ERROR_PAGE = (b"<!DOCTYPE html>\n<html><head><title>404 Not Found</title></head>\n<body><h1>Not Found</h1>"
              b"<p>The requested URL was not found on this server.</p></body></html>\n")
S3_ERROR = (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>AccessDenied</Code>'
            b"<Message>Request has expired</Message></Error>")
API_ERROR = b'{"message": "Not Found", "status": 404}\n'

SERVED = [
    ("report.pdf", ERROR_PAGE, '"report.pdf" is really a web page (HTML), not a PDF: it may be an error page saved '
                               "instead of the file. Download the file again (if it is what you meant to drop, "
                               "rename it to .html and drop it again)."),
    ("report.docx", b"\xef\xbb\xbf  \r\n" + ERROR_PAGE.replace(b"<!DOCTYPE html>", b"<!-- served by nginx -->"),
     '"report.docx" is really a web page (HTML), not a Word document: it may be an error page saved instead of'),
    ("statement.pdf", S3_ERROR, '"statement.pdf" is really an XML file, not a PDF: it may be a server\'s error '
                                "message saved instead of the file. Download the file again (if it is what you meant "
                                "to drop, rename it to .xml and drop it again)."),
    ("memo.docx", API_ERROR, '"memo.docx" is really a JSON file, not a Word document: it may be a server\'s error '
                             "message saved instead of the file."),
    # a bare fragment, as some servers send for an error: it was read as text
    ("invoice.pdf", b"<center><h1>502 Bad Gateway</h1></center>\r\n<hr><center>nginx</center>\r\n",
     '"invoice.pdf" is really a web page (HTML), not a PDF: it may be an error page saved instead of the file.'),
    ("invoice.docx", b"<h1>403 Forbidden</h1>\n",
     '"invoice.docx" is really a web page (HTML), not a Word document: it may be an error page saved instead'),
]


@pytest.mark.parametrize(("name", "data", "says"), SERVED, ids=[case[0] for case in SERVED])
def test_a_page_or_server_reply_under_a_pdf_or_word_name_is_refused_as_a_failed_download(tmp_path, name, data,
                                                                                          says):
    # it said "not a valid PDF file (no PDF header)" or "could not be read as a Word document: File is not a zip"
    err = refused(write(tmp_path, name, data))
    assert err.reason == "unreadable" and str(err).startswith(says), str(err)


PROSE = "\n".join(LINES[:12]) + "\n"


@pytest.mark.parametrize(("name", "promised"), [("notes.pdf", "a PDF"), ("notes.docx", "a Word document")])
def test_prose_under_a_pdf_or_word_name_is_read_as_text_with_a_note(tmp_path, name, promised):
    # a .txt renamed: what the user wants is its text, and the note says what the file really is
    doc = load_document(write(tmp_path, name, PROSE.encode()))
    assert doc.kind == "text" and doc.text == PROSE.rstrip() and doc.name == name
    assert doc.notes == (f'"{name}" is a text file, not {promised}; read as text.',)
    # a text that mentions HTML's tags without being a page, or quotes JSON, is prose too
    about = "Every page has a <body> element and an <html> root.\n{\"a\": 1} is a JSON object.\n"
    assert load_document(write(tmp_path, name, about.encode())).text == about.rstrip()
    # a README that opens with markup (a centred logo) and goes on as prose is a text, not an error page
    readme = '<p align="center"><img src="logo.png"></p>\n\n' + PROSE * 3
    assert load_document(write(tmp_path, name, readme.encode())).text == readme.rstrip()
    legacy = load_document(write(tmp_path, name, "Résumé du café, réunion à neuf heures.\n".encode("cp1252")))
    assert legacy.text == "Résumé du café, réunion à neuf heures."
    assert legacy.notes[0] == f'"{name}" is a text file, not {promised}; read as text.'
    assert legacy.notes[1].startswith("not UTF-8: read as")


@pytest.mark.parametrize(("name", "promised"), [("report.pdf", "a PDF"), ("report.docx", "a Word document")])
def test_an_empty_file_under_a_pdf_or_word_name_says_the_download_may_have_failed(tmp_path, name, promised):
    err = refused(write(tmp_path, name, b""))
    assert err.reason == "empty" and str(err) == (f'"{name}" is empty (0 bytes), not {promised}: the download or '
                                                  "copy may have failed. Download or copy it again.")
    err = refused(write(tmp_path, name, b" \r\n\n"))
    assert err.reason == "empty" and str(err).startswith(f'"{name}" is empty (4 bytes of blank space), not {promised}')


def test_binary_noise_under_a_pdf_or_word_name_keeps_the_readers_message(tmp_path):
    noise = bytes(random.Random(11).randrange(256) for _ in range(4096)) + bytes(64)
    err = refused(write(tmp_path, "damaged.pdf", noise))
    assert err.reason == "unreadable" and "is not a valid PDF file (no PDF header)" in str(err)
    err = refused(write(tmp_path, "damaged.docx", noise))
    assert err.reason == "unreadable" and "could not be read as a Word document" in str(err)


# --------------------------------------------------------------------------------------------------
# No suffix, or one this app does not know: text is read as text
# --------------------------------------------------------------------------------------------------


def test_a_text_file_without_a_known_suffix_is_read_as_text(tmp_path):
    body = "Meeting notes\nThe café opens at nine; 会议在九点开始。\n"
    for name in ("notes", "notes.weird", "export.xls"):  # a web app's "spreadsheet" that is a CSV or text
        doc = load_document(write(tmp_path, name, body.encode()))
        assert doc.kind == "text" and doc.text == body.rstrip()
        assert doc.notes == (f'"{name}" is a text file; read as text.',)
    page = b"<!doctype html><html><head><title>T</title></head><body><h1>Harbour</h1><p>Ships: 40</p></body></html>"
    doc = load_document(write(tmp_path, "page", page))
    assert doc.kind == "web" and "# Harbour" in doc.text and "<p>" not in doc.text
    assert load_document(write(tmp_path, "page.txt", page)).text == page.decode()  # .txt: its source, as before


def test_is_supported_takes_a_name_without_a_suffix():
    assert is_supported("report") and is_supported(os.path.join("Downloads", "report"))
    assert is_supported("report.pdf") and is_supported("notes.txt")
    assert not is_supported("photo.png") and not is_supported("setup.exe")


# --------------------------------------------------------------------------------------------------
# Content no reader reads: named
# --------------------------------------------------------------------------------------------------


def _xlsx() -> bytes:
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as zf:
        zf.writestr("[Content_Types].xml", "<Types/>")
        zf.writestr("xl/workbook.xml", "<workbook/>")
    return out.getvalue()


def _zip() -> bytes:
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as zf:
        zf.writestr("photos/a.txt", "hello")
    return out.getvalue()


def _ole(*streams: str) -> bytes:
    return OLE + bytes(504) + b"".join(s.encode("utf-16-le") + bytes(64 - 2 * len(s)) for s in streams)


PNG = b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR" + bytes(64)


NAMED = [
    ("letter.pdf", _ole("Root Entry", "WordDocument"), "unsupported",
     '"letter.pdf" is really a legacy Word .doc file, not a PDF. Open it in Word or LibreOffice, save it as .docx'),
    ("letter", _ole("Root Entry", "WordDocument"), "unsupported",
     '"letter" can\'t be read: it is a legacy Word .doc file. Open it in Word or LibreOffice, save it as .docx'),
    ("budget.docx", _xlsx(), "unsupported", '"budget.docx" is really an Excel .xlsx spreadsheet, not a Word '
                                            'document. Spreadsheets are not supported; export the sheet as .csv'),
    ("photos.docx", _zip(), "unsupported", '"photos.docx" is really a zip archive, not a Word document. Unpack it'),
    ("locked.pdf", _ole("Root Entry", "EncryptedPackage"), "encrypted",
     '"locked.pdf" is really a password-protected Office document, not a PDF. Open it in Office, remove the password'),
    ("photo.txt", PNG, "unsupported", '"photo.txt" is really a PNG image, not a text file.'),
    ("photo", PNG, "unsupported", '"photo" can\'t be read: it is a PNG image.'),
    ("scan.pdf", b"\xff\xd8\xff\xe0\x00\x10JFIF\x00" + bytes(64), "unsupported", '"scan.pdf" is really a JPEG image'),
    ("tool", b"MZ\x90\x00\x03" + bytes(120), "unsupported", '"tool" can\'t be read: it is a Windows program.'),
]


@pytest.mark.parametrize(("name", "data", "reason", "says"), NAMED, ids=[case[0] for case in NAMED])
def test_content_no_reader_reads_is_named(tmp_path, name, data, reason, says):
    err = refused(write(tmp_path, name, data))
    assert err.reason == reason and str(err).startswith(says), str(err)


def test_binary_of_unknown_kind_keeps_the_not_supported_message(tmp_path):
    noise = bytes(random.Random(7).randrange(256) for _ in range(4096)) + bytes(64)
    err = refused(write(tmp_path, "blob.bin", noise))
    assert err.reason == "unsupported" and ".bin files are not supported" in str(err) and ".docx" in str(err)
    err = refused(write(tmp_path, "blob", noise))
    assert err.reason == "unsupported" and "no suffix" in str(err) and "not PDF, Word or text" in str(err)
    # a name that does not lie keeps the message it had
    assert ".png files are not supported" in str(refused(write(tmp_path, "photo.png", PNG)))
    assert "save it as .docx" in str(refused(write(tmp_path, "old.doc", _ole("Root Entry", "WordDocument"))))
    for name in ("old.docx", "old.docm"):  # not "with a .docx name" for a .docm
        message = str(refused(write(tmp_path, name, _ole("WordDocument"))))
        assert "old Word .doc file under a newer Word file's name" in message and "save it as .docx" in message


def test_a_large_program_without_a_suffix_is_named_not_called_too_large(tmp_path):
    program = write(tmp_path, "installer", b"MZ\x90\x00" + bytes(4096))
    with pytest.raises(DocumentError) as exc_info:
        load_document(program, max_bytes=1024)
    assert exc_info.value.reason == "unsupported" and "Windows program" in str(exc_info.value)
    blob = write(tmp_path, "blob", bytes(random.Random(3).randrange(256) for _ in range(4096)) + bytes(64))
    with pytest.raises(DocumentError) as exc_info:
        load_document(blob, max_bytes=1024)
    assert exc_info.value.reason == "unsupported" and "no suffix" in str(exc_info.value)
    text = write(tmp_path, "server-log", b"GET /index.html 200\n" * 200)
    with pytest.raises(DocumentError) as exc_info:
        load_document(text, max_bytes=1024)
    assert exc_info.value.reason == "too_large"
