"""A PDF written by Qt's own QPdfWriter joins words with tabs in its text layer: it must count as many
tokens as the same text as a plain file (it counted nearly twice as many and was refused as too long)."""

from __future__ import annotations

from engine.documents import load_document

SPEECH = ("Madam Speaker, Madam Vice President, and my fellow Americans.\nWe meet tonight at a moment of great "
          "consequence, with work to do and a country to serve.\n") * 40


def test_a_qt_written_pdf_counts_like_its_text(qapp, tmp_path, default_model):
    from PySide6.QtGui import QPageSize, QPdfWriter, QTextDocument

    path = tmp_path / "speech.pdf"
    writer = QPdfWriter(str(path))
    writer.setPageSize(QPageSize(QPageSize.PageSizeId.A4))
    document = QTextDocument()
    document.setPlainText(SPEECH)
    document.print_(writer)
    del writer  # finishes the file
    text = load_document(path).text
    assert "\t" not in text and "Madam Speaker, Madam Vice President" in text
    count = default_model.count_tokens
    assert count(text) <= 1.05 * count(SPEECH)
