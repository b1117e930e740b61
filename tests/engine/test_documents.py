"""Tests for engine.documents: text extraction from files dropped into the chat.

Fixtures are built at test time from real text: English technical prose from the stdlib's
``pydoc_data.topics`` and a Chinese paragraph; PDFs come from a minimal PDF writer below (pypdf
cannot lay out text), encrypted PDFs from pypdf's own ``PdfWriter.encrypt``, .docx from python-docx.
"""

from __future__ import annotations

import io
import os
import pickle
import random
import re
from concurrent.futures import ThreadPoolExecutor
from pydoc_data.topics import topics

import pytest

from engine.documents import (
    DEFAULT_MAX_BYTES,
    DEFAULT_MAX_CHARS,
    SUPPORTED_SUFFIXES,
    Document,
    DocumentError,
    format_for_prompt,
    is_supported,
    load_document,
)
from engine.errors import EngineError
from tests.pdf_writer import make_pdf

# The opening of 《桃花源记》 (陶渊明), plus a modern sentence and a character outside the BMP (𠮷) so that
# UTF-16 surrogate pairs are exercised.
CHINESE = (
    "晋太元中，武陵人捕鱼为业。缘溪行，忘路之远近。忽逢桃花林，夹岸数百步，中无杂树，芳草鲜美，落英缤纷。"
    "渔人甚异之，复前行，欲穷其林。林尽水源，便得一山，山有小口，仿佛若有光。\n"
    "长文档对话需要把整份文件放进上下文窗口；“压缩缓存”让显存占用保持可控。𠮷野家的招牌也没有乱码。"
)


def english(topic: str = "if") -> str:
    return topics[topic]


def ascii_lines(*names: str) -> list[str]:
    out: list[str] = []
    for name in names:
        out.extend(line for line in topics[name].splitlines() if line.isascii() and line.strip())
    return out


def squash(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip()



PDF_PAGES = [ascii_lines("if")[:60], ascii_lines("while", "for")[:60], ascii_lines("try")[:60]]


@pytest.fixture(scope="module")
def pdf_bytes() -> bytes:
    return make_pdf(PDF_PAGES)


@pytest.fixture
def pdf_file(tmp_path, pdf_bytes):
    path = tmp_path / "report.pdf"
    path.write_bytes(pdf_bytes)
    return path


def encrypt_pdf(src, dst, user_password: str, owner_password: str = "owner-secret") -> None:
    from pypdf import PdfWriter

    writer = PdfWriter(clone_from=str(src))
    # RC4-128 needs no optional crypto library, so this works on every install.
    writer.encrypt(user_password, owner_password, algorithm="RC4-128")
    with open(dst, "wb") as fh:
        writer.write(fh)


def assert_error(exc_info, reason: str, name: str) -> DocumentError:
    err = exc_info.value
    assert isinstance(err, DocumentError)
    assert isinstance(err, ValueError)
    assert isinstance(err, EngineError)
    assert err.reason == reason, (err.reason, str(err))
    assert name in str(err), str(err)
    return err


# --------------------------------------------------------------------------------------------------
# Text, Markdown and source files
# --------------------------------------------------------------------------------------------------


def test_plain_text_utf8(tmp_path):
    body = english("if") + "\n" + CHINESE + "\n"
    path = tmp_path / "notes.txt"
    path.write_text(body, encoding="utf-8")
    doc = load_document(path)
    assert isinstance(doc, Document)
    assert doc.name == "notes.txt"
    assert doc.path == str(path.resolve())
    assert doc.kind == "text"
    assert doc.pages is None
    assert doc.text == body.rstrip()
    assert CHINESE in doc.text
    assert doc.chars == len(doc.text)


def test_kinds_by_suffix(tmp_path):
    cases = {"readme.md": "markdown", "main.py": "source", "query.SQL": "source", "data.csv": "text",
             "conf.yaml": "source", "paper.tex": "source", "Makefile": "source", "server.log": "text"}  # fmt: skip
    for name, kind in cases.items():
        path = tmp_path / name
        path.write_text(english("while"), encoding="utf-8")
        doc = load_document(path)
        assert doc.kind == kind, name
        assert doc.text == english("while").rstrip()


def test_utf8_with_bom(tmp_path):
    path = tmp_path / "bom.md"
    path.write_bytes(b"\xef\xbb\xbf" + ("# 标题\n\n" + CHINESE).encode("utf-8"))
    doc = load_document(path)
    assert doc.text == "# 标题\n\n" + CHINESE
    assert not doc.text.startswith("\ufeff")


@pytest.mark.parametrize("encoding", ["utf-16", "utf-16-be", "utf-32"])
def test_utf16_and_utf32_with_bom(tmp_path, encoding):
    body = english("for") + CHINESE
    raw = body.encode(encoding)
    if encoding == "utf-16-be":
        raw = b"\xfe\xff" + raw
    path = tmp_path / "windows.txt"
    path.write_bytes(raw)
    doc = load_document(path)
    assert doc.text == body.rstrip()
    assert "𠮷" in doc.text


def test_legacy_western_encoding(tmp_path):
    body = english("if") + "\nCafé, naïve résumé — “smart quotes” for the façade.\n"
    path = tmp_path / "legacy.txt"
    path.write_bytes(body.encode("cp1252"))
    assert load_document(path).text == body.rstrip()


@pytest.mark.parametrize("text, encoding, named", [
    ("姓名,年龄,城市\n张三,30,北京\n李四,25,上海\n", "gbk", "gb18030"),  # a CSV Excel saved in China
    ("明日の会議は午後三時からです。", "cp932", "cp932"),
    ("Привет, как дела? Всё хорошо.", "cp1251", "Windows-1251"),
])
def test_a_short_text_in_a_legacy_code_page_of_another_script_is_read(tmp_path, text, encoding, named):
    path = tmp_path / "short.csv"
    path.write_bytes(text.encode(encoding))
    assert len(path.read_bytes()) < 64
    doc = load_document(path)
    assert doc.text == text.rstrip() and f"read as {named}" in " ".join(doc.notes)


def test_a_short_latin_text_is_read_as_windows_1252_not_a_look_alike_code_page(tmp_path):
    path = tmp_path / "menu.txt"
    path.write_bytes("café crème brûlée".encode("cp1252"))  # the detector names Central European cp1250 for it
    doc = load_document(path)
    assert doc.text == "café crème brûlée" and "read as Windows-1252" in " ".join(doc.notes)


def test_terminal_escape_sequences_are_taken_out(tmp_path):
    path = tmp_path / "build.log"
    path.write_bytes(b"\x1b[31mERROR\x1b[0m disk full\n\x1b]0;make\x07\x1b[1;32mOK\x1b[m done\n")
    assert load_document(path).text == "ERROR disk full\nOK done"


def test_dotfiles_are_text_and_a_home_path_is_expanded(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / ".bashrc").write_text("export EDITOR=vim\n")
    doc = load_document("~/.bashrc")
    assert doc.text == "export EDITOR=vim" and doc.path == str(tmp_path / ".bashrc")


def test_legacy_chinese_gb18030(tmp_path):
    path = tmp_path / "gbk.txt"
    path.write_bytes(CHINESE.encode("gb18030"))
    assert load_document(path).text == CHINESE


def test_utf8_with_a_stray_byte_keeps_the_chinese(tmp_path):
    raw = (CHINESE * 20).encode("utf-8") + b" \x93quoted\x94 " + (CHINESE * 20).encode("utf-8")
    path = tmp_path / "mixed.txt"
    path.write_bytes(raw)
    text = load_document(path).text
    assert text.startswith(CHINESE)
    assert text.count("桃花源") == 0 and text.count("桃花林") == 40


def test_normalisation(tmp_path):
    lines = [line for line in english("while").splitlines() if line.strip()]
    filler = english("assignment")  # > 8 KiB, so the NUL below lies beyond the binary sniff window
    assert len(filler.encode()) > 8192
    raw = (
        "\r\n".join(lines[:3]) + "\r\n\r\n\r\n\r\n\r\n\r\n" + "\r".join(lines[3:6]) + "\n" + filler
        + "\x00\n \n\t\n\n\n\n" + CHINESE
    )  # fmt: skip
    path = tmp_path / "messy.txt"
    path.write_bytes(b"\n\n" + raw.encode("utf-8") + b"\n\n\n")
    text = load_document(path).text
    assert "\r" not in text and "\x00" not in text
    assert "\n\n\n\n" not in text  # never more than two blank lines in a row
    assert text.startswith(lines[0])
    assert text.endswith("\n\n\n" + CHINESE)
    assert "\n".join(lines[:3]) + "\n\n\n" + "\n".join(lines[3:6]) in text


def test_nul_in_first_8k_means_binary(tmp_path):
    path = tmp_path / "padded.log"
    path.write_bytes(english("if").encode() + b"\x00" * 16)
    with pytest.raises(DocumentError) as exc_info:
        load_document(path)
    assert_error(exc_info, "binary", "padded.log")


def test_source_indentation_is_kept(tmp_path):
    code = "    def f(x):\n        return x  # 注释\n\n\n\n\nclass A:\n    pass\n"
    path = tmp_path / "snippet.py"
    path.write_text(code, encoding="utf-8")
    assert load_document(path).text == "    def f(x):\n        return x  # 注释\n\n\nclass A:\n    pass"


# --------------------------------------------------------------------------------------------------
# PDF
# --------------------------------------------------------------------------------------------------


def test_pdf_fixture_is_read_by_pypdf(pdf_bytes):
    from pypdf import PdfReader

    reader = PdfReader(io.BytesIO(pdf_bytes))
    assert len(reader.pages) == 3
    assert PDF_PAGES[0][0] in reader.pages[0].extract_text()


def test_pdf(pdf_file):
    doc = load_document(pdf_file)
    assert doc.kind == "pdf"
    assert doc.name == "report.pdf"
    assert doc.pages == 3
    flat = squash(doc.text)
    for page in PDF_PAGES:
        for line in page:
            assert squash(line) in flat
    # Pages are separated by one blank line, in order.
    chunks = doc.text.split("\n\n")
    assert len(chunks) == 3
    assert chunks[1].startswith(PDF_PAGES[1][0].strip())
    assert doc.chars == len(doc.text)


def test_pdf_with_empty_user_password_opens(tmp_path, pdf_file):
    locked = tmp_path / "restricted.pdf"
    encrypt_pdf(pdf_file, locked, user_password="")
    doc = load_document(locked)
    assert doc.pages == 3
    assert squash(PDF_PAGES[2][-1]) in squash(doc.text)


def test_pdf_encrypted(tmp_path, pdf_file):
    locked = tmp_path / "secret report.pdf"
    encrypt_pdf(pdf_file, locked, user_password="hunter2")
    with pytest.raises(DocumentError) as exc_info:
        load_document(locked)
    err = assert_error(exc_info, "encrypted", "secret report.pdf")
    assert "password" in str(err).lower()


def test_pdf_aes_without_crypto_library_is_reported_as_encrypted(tmp_path, pdf_file, monkeypatch):
    # AES needs the optional `cryptography` package; simulate its absence on a file pypdf can write.
    from pypdf import PdfReader
    from pypdf.errors import DependencyError

    locked = tmp_path / "aes.pdf"
    encrypt_pdf(pdf_file, locked, user_password="")

    def no_aes(self, password):
        raise DependencyError("cryptography>=3.1 is required for AES algorithm")

    monkeypatch.setattr(PdfReader, "decrypt", no_aes)
    with pytest.raises(DocumentError) as exc_info:
        load_document(locked)
    assert "AES" in str(assert_error(exc_info, "encrypted", "aes.pdf"))


def test_pdf_scanned(tmp_path):
    path = tmp_path / "scan.pdf"
    path.write_bytes(make_pdf([None, None]))
    with pytest.raises(DocumentError) as exc_info:
        load_document(path)
    err = assert_error(exc_info, "empty", "scan.pdf")
    assert "scanned" in str(err) and "OCR" in str(err)


def test_pdf_page_numbers_only_counts_as_scanned(tmp_path):
    path = tmp_path / "numbers.pdf"
    path.write_bytes(make_pdf([[str(i)] for i in range(1, 6)]))
    with pytest.raises(DocumentError) as exc_info:
        load_document(path)
    assert_error(exc_info, "empty", "numbers.pdf")


def test_pdf_mixed_text_and_image_pages(tmp_path):
    path = tmp_path / "mixed.pdf"
    path.write_bytes(make_pdf([PDF_PAGES[0], None, PDF_PAGES[2]]))
    doc = load_document(path)
    assert doc.pages == 3
    assert squash(PDF_PAGES[2][0]) in squash(doc.text)


def test_a_damaged_page_is_marked_and_said_not_read_as_blank(tmp_path):
    """pypdf reads a page whose content stream does not decompress as blank: the model would miss it unseen."""
    path = tmp_path / "damaged.pdf"
    path.write_bytes(make_pdf(PDF_PAGES, damaged=(2,)))
    doc = load_document(path)
    assert doc.pages == 3 and "[page 2: text could not be extracted]" in doc.text
    assert squash(PDF_PAGES[0][0]) in squash(doc.text) and squash(PDF_PAGES[2][0]) in squash(doc.text)
    assert squash(PDF_PAGES[1][0]) not in squash(doc.text)
    assert any("Page 2 of this PDF could not be read (damaged)" in note for note in doc.notes), doc.notes
    path.write_bytes(make_pdf([PDF_PAGES[0]], damaged=(1,)))  # nothing readable: damaged, not "scanned"
    with pytest.raises(DocumentError) as exc_info:
        load_document(path)
    err = assert_error(exc_info, "unreadable", "damaged.pdf")
    assert "damaged" in str(err) and "OCR" not in str(err)
    path.write_bytes(make_pdf([PDF_PAGES[0], None]))  # a page with no text at all is no damage
    assert load_document(path).notes == ()


def test_a_lone_surrogate_becomes_a_replacement_character_with_a_note():
    """A broken font map can give half a UTF-16 pair: no character, which nothing can encode (storing the chat
    failed on it)."""
    from engine.documents.core import _normalise
    from engine.documents.pdf import _clean_pdf_text

    notes: list[str] = []
    assert _clean_pdf_text("The value is \ud835A here", notes) == "The value is \ufffdA here"
    assert len(notes) == 1 and "1 character of this PDF could not be read" in notes[0]
    assert _normalise("a\udc80b") == "a\ufffdb"
    _normalise("a\ud835b").encode("utf-8")  # encodable


@pytest.mark.parametrize("fraction", [0.3, 0.6, 0.95])
def test_pdf_truncated(tmp_path, pdf_bytes, fraction, caplog):
    path = tmp_path / "truncated.pdf"
    path.write_bytes(pdf_bytes[: int(len(pdf_bytes) * fraction)])
    with pytest.raises(DocumentError) as exc_info:
        load_document(path)
    assert not [r for r in caplog.records if r.name.startswith("pypdf")]  # only our message reaches the user
    err = assert_error(exc_info, "unreadable", "truncated.pdf")
    assert len(str(err)) > len('"truncated.pdf" could not be read as a PDF: ')  # the parser's reason
    assert "looks incomplete" in str(err) and "download or copy it again" in str(err)  # and what to do


def test_pdf_that_is_not_a_pdf(tmp_path):
    path = tmp_path / "fake.pdf"
    path.write_bytes(bytes(range(256)) * 8)  # neither a PDF nor text (text under a .pdf name: test_document_names)
    with pytest.raises(DocumentError) as exc_info:
        load_document(path)
    err = assert_error(exc_info, "unreadable", "fake.pdf")
    assert "not a valid PDF file" in str(err)


# --------------------------------------------------------------------------------------------------
# Word
# --------------------------------------------------------------------------------------------------


def make_docx(path) -> list[str]:
    import docx

    paragraphs = [p for p in english("try").split("\n\n") if p.strip() and "*" not in p][:4]
    d = docx.Document()
    d.add_heading("Exception handling 异常处理", level=1)
    for p in paragraphs[:2]:
        d.add_paragraph(p)
    table = d.add_table(rows=3, cols=2)
    cells = [("Statement", "语句"), ("try", "尝试执行"), ("except", "捕获异常")]
    for r, (a, b) in enumerate(cells):
        table.cell(r, 0).text = a
        table.cell(r, 1).text = b
    d.add_paragraph(CHINESE)
    for p in paragraphs[2:]:
        d.add_paragraph(p)
    d.save(str(path))
    return paragraphs


def test_docx(tmp_path):
    path = tmp_path / "说明 notes.docx"
    paragraphs = make_docx(path)
    doc = load_document(path)
    assert doc.kind == "docx"
    assert doc.name == "说明 notes.docx"
    assert doc.pages is None
    text = doc.text
    assert text.startswith("# Exception handling 异常处理")
    for p in paragraphs:
        assert p.strip() in text
    assert "| try | 尝试执行 |" in text
    assert "| except | 捕获异常 |" in text
    assert CHINESE in text
    # document order: paragraphs, table, Chinese paragraph, more paragraphs
    assert text.index(paragraphs[1].strip()) < text.index("| Statement | 语句 |") < text.index(CHINESE)
    assert text.index(CHINESE) < text.index(paragraphs[2].strip())


def test_docx_keeps_what_word_shows_beyond_plain_paragraphs(tmp_path):
    """Headers, footers, footnotes, tracked insertions, content controls and list items were dropped without a
    word: the model read a contract without its footnotes and a draft without its inserted sentence."""
    import copy
    import zipfile

    import docx
    from docx.oxml.ns import qn

    d = docx.Document()
    d.sections[0].header.paragraphs[0].text = "CONFIDENTIAL HEADER TEXT"
    d.sections[0].footer.paragraphs[0].text = "Footer page note ACME Corp"
    body = d.add_paragraph("Revenue rose by 4 percent.")
    inserted = docx.oxml.parse_xml(
        '<w:ins xmlns:w="http://schemas.openxmlformats.org/wordprocessingml/2006/main" w:id="1" w:author="a">'
        '<w:r><w:t xml:space="preserve"> Profit fell by 3 percent.</w:t></w:r></w:ins>')
    body._p.append(inserted)
    deleted = docx.oxml.parse_xml(
        '<w:del xmlns:w="http://schemas.openxmlformats.org/wordprocessingml/2006/main" w:id="2" w:author="a">'
        '<w:r><w:delText>REMOVED WORDS</w:delText></w:r></w:del>')
    body._p.append(deleted)
    d.add_paragraph("First bullet", style="List Bullet")
    d.add_paragraph("Second bullet", style="List Bullet")
    cover = d.add_paragraph("Cover page: Project Falcon")
    sdt = docx.oxml.parse_xml('<w:sdt xmlns:w="http://schemas.openxmlformats.org/wordprocessingml/2006/main">'
                              '<w:sdtContent/></w:sdt>')
    sdt.find(qn("w:sdtContent")).append(copy.deepcopy(cover._p))
    cover._p.addprevious(sdt)
    cover._p.getparent().remove(cover._p)
    path = tmp_path / "report.docx"
    d.save(str(path))
    notes = ('<w:footnotes xmlns:w="http://schemas.openxmlformats.org/wordprocessingml/2006/main">'
             '<w:footnote w:id="-1"><w:p><w:r><w:t>SEPARATOR</w:t></w:r></w:p></w:footnote>'
             '<w:footnote w:id="1"><w:p><w:r><w:t>Source: internal audit 2023, table 7.</w:t></w:r></w:p>'
             '</w:footnote></w:footnotes>')
    with zipfile.ZipFile(path, "a") as zf:
        zf.writestr("word/footnotes.xml", notes)
    text = load_document(path).text
    assert "Revenue rose by 4 percent. Profit fell by 3 percent." in text and "REMOVED WORDS" not in text
    assert "- First bullet" in text and "- Second bullet" in text
    assert "Cover page: Project Falcon" in text
    assert "CONFIDENTIAL HEADER TEXT" in text and "Footer page note ACME Corp" in text
    assert "Footnotes:\n[1] Source: internal audit 2023, table 7." in text and "SEPARATOR" not in text
    assert text.index("Revenue") < text.index("CONFIDENTIAL")  # the body first


def test_docx_corrupt(tmp_path):
    good = tmp_path / "good.docx"
    make_docx(good)
    data = good.read_bytes()
    path = tmp_path / "broken.docx"
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(DocumentError) as exc_info:
        load_document(path)
    assert_error(exc_info, "unreadable", "broken.docx")


def test_docx_that_is_an_old_doc(tmp_path):
    path = tmp_path / "old.docx"
    path.write_bytes(b"\xd0\xcf\x11\xe0\xa1\xb1\x1a\xe1" + bytes(504))
    with pytest.raises(DocumentError) as exc_info:
        load_document(path)
    err = assert_error(exc_info, "unreadable", "old.docx")
    assert ".doc" in str(err)


def test_docx_without_text(tmp_path):
    import docx

    path = tmp_path / "blank.docx"
    docx.Document().save(str(path))
    with pytest.raises(DocumentError) as exc_info:
        load_document(path)
    assert_error(exc_info, "empty", "blank.docx")


# --------------------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------------------


def test_binary_file(tmp_path):
    rng = random.Random(1234)
    data = bytes(rng.randrange(256) for _ in range(4096)) + b"\x00" * 64
    path = tmp_path / "dump.txt"
    path.write_bytes(data)
    with pytest.raises(DocumentError) as exc_info:
        load_document(path)
    assert_error(exc_info, "binary", "dump.txt")


def test_binary_without_nul_bytes(tmp_path):
    rng = random.Random(99)
    data = bytes(b for b in (rng.randrange(256) for _ in range(8192)) if b)
    path = tmp_path / "noise.log"
    path.write_bytes(data)
    with pytest.raises(DocumentError) as exc_info:
        load_document(path)
    assert_error(exc_info, "binary", "noise.log")


def test_utf16_without_bom_is_rejected_with_a_hint(tmp_path):
    path = tmp_path / "nobom.txt"
    path.write_bytes(english("if").encode("utf-16-le"))
    with pytest.raises(DocumentError) as exc_info:
        load_document(path)
    err = assert_error(exc_info, "binary", "nobom.txt")
    assert "UTF-8" in str(err)


def test_too_large_bytes(tmp_path):
    path = tmp_path / "big.txt"
    path.write_text(english("if"), encoding="utf-8")
    size = path.stat().st_size
    with pytest.raises(DocumentError) as exc_info:
        load_document(path, max_bytes=100)
    err = assert_error(exc_info, "too_large", "big.txt")
    assert f"{size:,}" in str(err) and "100 bytes" in str(err)


def test_too_large_chars(tmp_path, pdf_file):
    path = tmp_path / "long.md"
    path.write_text(english("if"), encoding="utf-8")
    n = len(english("if").rstrip())
    with pytest.raises(DocumentError) as exc_info:
        load_document(path, max_chars=500)
    err = assert_error(exc_info, "too_large", "long.md")
    assert f"{n:,}" in str(err) and "500" in str(err)
    with pytest.raises(DocumentError) as exc_info:
        load_document(pdf_file, max_chars=200)
    assert_error(exc_info, "too_large", "report.pdf")


def test_unsupported_suffix(tmp_path):
    path = tmp_path / "setup.exe"
    path.write_bytes(b"MZ" + bytes(100))
    with pytest.raises(DocumentError) as exc_info:
        load_document(path)
    err = assert_error(exc_info, "unsupported", "setup.exe")
    for suffix in (".pdf", ".docx", ".txt", ".md", ".py"):
        assert suffix in str(err)
    # one readable line naming the kinds, not every one of about a hundred suffixes
    assert "\n" not in str(err) and len(str(err)) < 300 and ".zsh" not in str(err)


def test_unsupported_doc_gets_a_hint(tmp_path):
    path = tmp_path / "letter.doc"
    path.write_bytes(b"\xd0\xcf\x11\xe0")
    with pytest.raises(DocumentError) as exc_info:
        load_document(path)
    message = str(assert_error(exc_info, "unsupported", "letter.doc"))
    assert "save it as .docx" in message
    assert message.count("not supported") == 1, message  # the hint does not say it again


@pytest.mark.parametrize("name", ["budget.xlsx", "slides.pptx", "book.epub", "old.xls", "old.ppt"])
def test_an_unsupported_kinds_hint_says_what_to_do_once(tmp_path, name):
    path = tmp_path / name
    path.write_bytes(b"\x00\x01 not a real file")
    with pytest.raises(DocumentError) as exc_info:
        load_document(path)
    assert str(exc_info.value).count("not supported") == 1, str(exc_info.value)


def test_missing_file(tmp_path):
    path = tmp_path / "gone.pdf"
    with pytest.raises(DocumentError) as exc_info:
        load_document(path)
    assert_error(exc_info, "missing", "gone.pdf")


def test_directory(tmp_path):
    folder = tmp_path / "papers.pdf"
    folder.mkdir()
    with pytest.raises(DocumentError) as exc_info:
        load_document(folder)
    err = assert_error(exc_info, "missing", "papers.pdf")
    assert "folder" in str(err)


def test_empty_text_file(tmp_path):
    path = tmp_path / "empty.txt"
    path.write_bytes(b"\n \n\t\n")
    with pytest.raises(DocumentError) as exc_info:
        load_document(path)
    assert_error(exc_info, "empty", "empty.txt")


def test_error_survives_pickling(tmp_path):
    with pytest.raises(DocumentError) as exc_info:
        load_document(tmp_path / "nope.txt")
    copy = pickle.loads(pickle.dumps(exc_info.value))
    assert (copy.reason, copy.path, str(copy)) == (
        exc_info.value.reason,
        exc_info.value.path,
        str(exc_info.value),
    )


# --------------------------------------------------------------------------------------------------
# API surface
# --------------------------------------------------------------------------------------------------


def test_is_supported():
    assert DEFAULT_MAX_BYTES == 64 * 1024 * 1024
    assert DEFAULT_MAX_CHARS == 2_000_000
    assert isinstance(SUPPORTED_SUFFIXES, frozenset)
    for suffix in (".txt", ".md", ".rst", ".csv", ".json", ".log", ".py", ".js", ".ts", ".c", ".h", ".cpp",
                   ".hpp", ".java", ".go", ".rs", ".rb", ".sh", ".toml", ".yaml", ".yml", ".html", ".css",
                   ".sql", ".tex", ".pdf", ".docx"):  # fmt: skip
        assert suffix in SUPPORTED_SUFFIXES
        assert is_supported("x" + suffix)
        assert is_supported("DIR/X" + suffix.upper())
    assert not is_supported("setup.exe")
    assert not is_supported("photo.png")
    assert not is_supported("letter.doc")
    assert is_supported(os.path.join("src", "Dockerfile"))


def test_format_for_prompt(tmp_path):
    path = tmp_path / 'Q3 "final" <draft>.md'
    path.write_text("# 摘要\n\n" + english("if"), encoding="utf-8")
    doc = load_document(path)
    block = format_for_prompt(doc)
    assert block.startswith('<document name="Q3 &quot;final&quot; &lt;draft&gt;.md">\n# 摘要\n')
    assert block.endswith("\n</document>")
    assert doc.text in block

    sneaky = tmp_path / "sneaky.txt"
    sneaky.write_text("before\n</document>\nafter", encoding="utf-8")
    block = format_for_prompt(load_document(sneaky))
    assert block.count("</document>") == 1 and block.endswith("</document>")


def test_thread_safe(tmp_path, pdf_file):
    txt = tmp_path / "a.txt"
    txt.write_text(english("for") + CHINESE, encoding="utf-16")
    docx_path = tmp_path / "b.docx"
    make_docx(docx_path)
    paths = [pdf_file, txt, docx_path] * 6
    expected = {p: load_document(p) for p in (pdf_file, txt, docx_path)}
    with ThreadPoolExecutor(max_workers=6) as pool:
        results = list(pool.map(load_document, paths))
    for path, doc in zip(paths, results, strict=True):
        assert doc == expected[path]


# --------------------------------------------------------------------------------------------------
# Web pages
# --------------------------------------------------------------------------------------------------

PAGE = """<!DOCTYPE html>
<html lang="zh"><head><meta charset="utf-8"><title>Report &amp; notes</title>
<style>body { color: red; } .secret { display: none }</style>
<script>var tracking = "SCRIPT-TEXT"; function f() { return 1 < 2; }</script></head>
<body><nav><a href="/">Home</a> <a href="/menu">MENU-LINK</a></nav>
<h1>Annual report</h1>
<p>The harbour   opened in <b>1887</b>,
after &lt;three&gt; years.</p><p hidden>HIDDEN-TEXT</p><div aria-hidden="true">ARIA-HIDDEN</div>
<h2>Figures</h2><ul><li>Ships: 40</li><li>Crew: 1,200</li></ul>
<table><tr><th>Year</th><th>Tonnage</th></tr><tr><td>1900</td><td>12,000</td></tr></table>
<pre>def f():
    return 1

print(f())</pre>
<p>晋太元中，武陵人捕鱼为业。<br>第二行</p><noscript>NOSCRIPT-TEXT</noscript>
</body></html>"""


def test_a_web_page_is_read_as_its_text(tmp_path):
    # A saved page is mostly markup: the model gets what a browser shows, in Markdown-like lines.
    path = tmp_path / "report.html"
    path.write_text(PAGE, encoding="utf-8")
    doc = load_document(path)
    assert doc.kind == "web"
    assert any("web page" in note and ".txt" in note for note in doc.notes)
    lines = doc.text.split("\n")
    assert lines[0] == "Report & notes"
    assert "# Annual report" in lines and "## Figures" in lines
    assert "The harbour opened in 1887, after <three> years." in lines
    assert "- Ships: 40" in lines and "- Crew: 1,200" in lines
    assert "Year | Tonnage" in lines and "1900 | 12,000" in lines
    assert "def f():\n    return 1\n\nprint(f())" in doc.text  # preformatted text kept as written
    assert "晋太元中，武陵人捕鱼为业。" in lines and "第二行" in lines
    for left_out in ("SCRIPT-TEXT", "color: red", "MENU-LINK", "HIDDEN-TEXT", "ARIA-HIDDEN", "NOSCRIPT-TEXT",
                     "<p", "&lt;", "charset"):
        assert left_out not in doc.text


def test_an_html_fragment_stays_source(tmp_path):
    # A template or snippet (no doctype, <html> or <body>) is code someone asks about: read as written.
    snippet = '<div class="card">\n  <button onclick="go()">Go</button>\n</div>\n'
    path = tmp_path / "card.htm"
    path.write_text(snippet, encoding="utf-8")
    doc = load_document(path)
    assert doc.kind == "source" and doc.text == snippet.rstrip() and doc.notes == ()
    # the same page saved as .txt is the user's way to ask about a page's source
    page = tmp_path / "report.txt"
    page.write_text(PAGE, encoding="utf-8")
    assert load_document(page).text == PAGE


def test_a_web_page_in_a_legacy_code_page(tmp_path):
    path = tmp_path / "old.htm"
    path.write_bytes(("<html><body><p>" + "Les élèves étaient très fiers de leur école. " * 20
                      + "</p></body></html>").encode("cp1252"))
    doc = load_document(path)
    assert doc.kind == "web" and doc.text.startswith("Les élèves étaient très fiers")


def test_a_page_with_nothing_to_read_is_empty(tmp_path):
    path = tmp_path / "app.html"
    path.write_text("<!doctype html><html><head><script>app()</script></head><body><div id=root></div></body></html>")
    with pytest.raises(DocumentError) as exc_info:
        load_document(path)
    assert exc_info.value.reason == "empty" and ".txt" in str(exc_info.value)


def test_a_pdf_radical_for_hu_reads_as_the_simplified_character_in_simplified_text():
    # Qt's PDF writer with a simplified-Chinese font writes 户 as the radical ⼾, whose NFKC form is the traditional 戶
    from engine.documents.pdf import _clean_pdf_text

    assert _clean_pdf_text("\u2f3e口 目录：这个门", []) == "户口 目录：这个门"
    assert _clean_pdf_text("門\u2f3e", []) == "門戶"  # a traditional text keeps NFKC's form
    assert _clean_pdf_text("\ufb01le \u2f6c", []) == "file 目"  # ligatures and other radicals as before
