"""Attached documents above the composer: one chip each, with pages, characters, tokens and KV memory."""

from __future__ import annotations

from pathlib import Path

from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import QFrame, QHBoxLayout, QLabel, QToolButton, QVBoxLayout, QWidget

from ..format import fmt_bytes, pages

BADGES = {"pdf": "PDF", "docx": "DOCX", "markdown": "MD", "source": "CODE", "text": "TXT", "web": "WEB"}


class DocumentChip(QFrame):
    remove_clicked = Signal(str)
    text_clicked = Signal(str)  # see the text the model reads

    def __init__(self, key: str, name: str, parent: QWidget | None = None):
        super().__init__(parent)
        self.key = key
        self.setObjectName("docChip")
        outer = QVBoxLayout(self)
        outer.setContentsMargins(8, 3, 4, 3)
        outer.setSpacing(1)
        row = QHBoxLayout()
        row.setSpacing(6)
        self.title = QLabel(f"Reading {name}…")
        self.title.setObjectName("docChipTitle")
        row.addWidget(self.title)
        self.figures = QLabel("")
        self.figures.setObjectName("docChipFigures")
        row.addWidget(self.figures, 1)
        self.show_text = QToolButton()
        self.show_text.setText("Text")
        self.show_text.setToolTip("See the text the model reads from this document")
        self.show_text.setAutoRaise(True)
        self.show_text.setEnabled(False)  # once it is read
        self.show_text.clicked.connect(lambda: self.text_clicked.emit(self.key))
        row.addWidget(self.show_text)
        self.remove = QToolButton()
        self.remove.setText("✕")
        self.remove.setToolTip("Remove this document")
        self.remove.setAutoRaise(True)
        self.remove.clicked.connect(lambda: self.remove_clicked.emit(self.key))
        row.addWidget(self.remove)
        outer.addLayout(row)
        self.warning = QLabel("")
        self.warning.setObjectName("docChipWarning")
        self.warning.setWordWrap(True)
        self.warning.hide()
        outer.addWidget(self.warning)
        self.document = None
        self.tokens: int | None = None  # counted by the worker; None while estimated

    def show_document(self, document) -> None:
        self.document = document
        self.title.setText(f"[{BADGES.get(document.kind, 'TXT')}] {document.name}")
        self.title.setToolTip(document.path)
        self.show_text.setEnabled(True)

    def show_figures(self, tokens: int, counted: bool, kv_bytes: int | None, ratio: float | None,
                     warning: str | None) -> None:
        doc = self.document
        parts = []
        if doc.pages:
            parts.append(pages(doc.pages))
        parts.append(f"{doc.chars:,} chars")
        parts.append(f"{tokens:,} tokens" if counted else f"~{tokens:,} tokens (est.)")
        if kv_bytes is not None and ratio is not None:
            parts.append(f"KV ≈ {fmt_bytes(kv_bytes)} at ×{ratio:.2f}")
        self.figures.setText(" · ".join(parts))
        lines = [f"ⓘ {note}" for note in getattr(doc, "notes", ())] + ([f"⚠ {warning}"] if warning else [])
        self.warning.setText("\n".join(lines))
        self.warning.setVisible(bool(lines))
        self.setProperty("state", "warning" if warning else "")
        self.style().unpolish(self)
        self.style().polish(self)


class DocumentChips(QWidget):
    """The list of chips; the window keeps the documents, this only shows them."""

    remove_requested = Signal(str)
    text_requested = Signal(str)

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self._layout = QVBoxLayout(self)
        self._layout.setContentsMargins(0, 0, 0, 0)
        self._layout.setSpacing(3)
        self.chips: dict[str, DocumentChip] = {}
        self.hide()

    def add_pending(self, key: str, path: str) -> DocumentChip:
        chip = DocumentChip(key, Path(path).name)
        chip.remove_clicked.connect(self.remove_requested)
        chip.text_clicked.connect(self.text_requested)
        self._layout.addWidget(chip, 0, Qt.AlignmentFlag.AlignTop)
        self.chips[key] = chip
        self.show()
        return chip

    def remove(self, key: str) -> None:
        chip = self.chips.pop(key, None)
        if chip is not None:
            self._layout.removeWidget(chip)
            chip.hide()  # out of the layout it would still be painted where it was until it is deleted
            chip.deleteLater()
        self.setVisible(bool(self.chips))

    def clear(self) -> None:
        for key in list(self.chips):
            self.remove(key)
