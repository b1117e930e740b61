"""Files that decode or extract badly: mis-encoded UTF-8 and tab-joined PDF text."""

from __future__ import annotations

from engine.documents import load_document
from tests.pdf_writer import make_pdf

SPEECH = ("Madam Speaker, Madam Vice President, and my fellow Americans. We meet tonight at a moment of great "
          "consequence for the café owners, the naïve dreamers and the résumé writers of this country.")


def test_utf8_with_a_few_invalid_bytes_stays_utf8_and_says_so(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_bytes(SPEECH.encode("utf-8") + b" \xff\xfe stray bytes.")
    doc = load_document(path)
    assert "café" in doc.text and "naïve" in doc.text and "Ã" not in doc.text
    assert doc.text.count("\ufffd") == 2
    assert doc.notes == ("2 bytes not valid UTF-8, replaced with \ufffd",)


def test_one_accent_and_one_bad_byte_is_still_utf8(tmp_path):
    """The issue's case: "café" and one invalid byte read as cp1252 gave "cafÃ©"."""
    path = tmp_path / "short.txt"
    path.write_bytes("A café.".encode() + b" \xff")
    doc = load_document(path)
    assert doc.text.startswith("A café.") and doc.notes


def test_a_file_joined_from_utf8_and_windows_1252_reads_both_right(tmp_path):
    """One UTF-8 accent and more Windows-1252 ones (a file pasted together from two editors): the UTF-8 text is
    not read as mojibake ("Café" -> "CafÃ©") and the lone Windows-1252 bytes are their characters, said."""
    path = tmp_path / "joined.txt"
    path.write_bytes("Café au lait.\n".encode() + "The naïve résumé writers, “quoted”.".encode("cp1252"))
    doc = load_document(path)
    assert doc.text == "Café au lait.\nThe naïve résumé writers, “quoted”."
    assert doc.notes == ("5 bytes not valid UTF-8, read as Windows-1252",)


def test_many_windows_1252_bytes_among_utf8_text(tmp_path):
    path = tmp_path / "many.txt"
    path.write_bytes(("Café " + "x" * 20).encode() * 50_000 + b"d\xe9j\xe0 vu " * 50_000)
    doc = load_document(path)
    assert doc.text.count("déjà vu") == 50_000 and "Ã" not in doc.text
    assert doc.notes == ("100000 bytes not valid UTF-8, read as Windows-1252",)


def test_a_real_legacy_file_is_detected_and_the_encoding_named(tmp_path):
    path = tmp_path / "legacy.txt"
    path.write_bytes((SPEECH + " “Quoted.”\n") .encode("cp1252") * 5)
    doc = load_document(path)
    assert "café" in doc.text and "“Quoted.”" in doc.text
    assert doc.notes == ("not UTF-8: read as Windows-1252",)


def test_clean_utf8_has_no_notes(tmp_path):
    path = tmp_path / "clean.txt"
    path.write_text(SPEECH, encoding="utf-8")
    assert load_document(path).notes == ()


def test_tab_joined_pdf_text_reads_like_the_text_file(tmp_path, default_model):
    lines = [SPEECH[i:i + 70] for i in range(0, len(SPEECH), 70)] * 12
    tabbed = [line.replace(" ", "\t") for line in lines]
    (tmp_path / "tabs.pdf").write_bytes(make_pdf([tabbed[:40], tabbed[40:]]))
    (tmp_path / "plain.pdf").write_bytes(make_pdf([lines[:40], lines[40:]]))
    tabs, plain = load_document(tmp_path / "tabs.pdf"), load_document(tmp_path / "plain.pdf")
    assert "\t" not in tabs.text and "  " not in tabs.text
    count = default_model.chat_session()._count
    assert abs(count(tabs.text) - count(plain.text)) <= 0.02 * count(plain.text)


def test_pdf_ligatures_radicals_and_unmapped_glyphs():
    """A PDF's text layer: ligatures and the radicals Qt's writer maps ideographs to read as the characters
    they stand for; glyphs it maps to nothing (they came out as control characters) are replaced and said."""
    from engine.documents import _clean_pdf_text

    notes: list[str] = []
    text = _clean_pdf_text("The ﬁnal budget is \x18.\x19 million. 猎⼾座项⽬", notes)
    assert text == "The final budget is \ufffd.\ufffd million. 猎戶座项目"
    assert len(notes) == 1 and notes[0].startswith("2 characters of this PDF could not be read")
    clean: list[str] = []
    assert _clean_pdf_text("Plain text, 中文。\n", clean) == "Plain text, 中文。\n" and clean == []
