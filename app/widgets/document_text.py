"""The text the model reads of an attached document: what the reader extracted from the PDF, Word file or web page
(columns, tables and headings as the reader laid them out), with its figures and the reader's notes, and a find
box. Opened from a document's chip before sending and from a sent message's attachment."""

from __future__ import annotations

from PySide6.QtCore import Qt
from PySide6.QtGui import QKeySequence, QShortcut, QTextDocument
from PySide6.QtWidgets import (
    QDialog,
    QDialogButtonBox,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QPlainTextEdit,
    QVBoxLayout,
    QWidget,
)

from ..format import pages as page_count


def describe(document) -> str:
    """'PDF · 6 pages · 21,530 chars' and the reader's notes, one per line."""
    parts = [document.kind.upper() if document.kind in ("pdf", "docx") else document.kind]
    if document.pages:
        parts.append(page_count(document.pages))
    parts.append(f"{document.chars:,} chars")
    return "\n".join([" · ".join(parts), *(f"ⓘ {note}" for note in getattr(document, "notes", ()) or ())])


class DocumentTextDialog(QDialog):
    def __init__(self, document, parent: QWidget | None = None):
        super().__init__(parent)
        self.setWindowTitle(f"{document.name} — the text the model reads")
        self.setAttribute(Qt.WidgetAttribute.WA_DeleteOnClose)
        self.resize(760, 640)
        layout = QVBoxLayout(self)
        self.figures = QLabel(describe(document))
        self.figures.setObjectName("dimLabel")
        self.figures.setWordWrap(True)
        layout.addWidget(self.figures)
        self.text = QPlainTextEdit()
        self.text.setReadOnly(True)
        self.text.setPlainText(document.text)
        layout.addWidget(self.text, 1)
        row = QHBoxLayout()
        self.find = QLineEdit()
        self.find.setPlaceholderText("Find in the text… (Enter: next, Shift+Enter: previous)")
        self.find.setClearButtonEnabled(True)
        self.find.returnPressed.connect(self.find_next)
        QShortcut(QKeySequence("Shift+Return"), self.find, activated=lambda: self.find_next(backward=True))
        QShortcut(QKeySequence(QKeySequence.StandardKey.Find), self, activated=self.find.setFocus)
        row.addWidget(self.find, 1)
        self.found = QLabel("")
        self.found.setObjectName("dimLabel")
        row.addWidget(self.found)
        layout.addLayout(row)
        buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Close)
        buttons.rejected.connect(self.close)
        layout.addWidget(buttons)

    def find_next(self, backward: bool = False) -> bool:
        """Select the next (or previous) occurrence of the find box's text, from the start again at the end;
        whether there is one."""
        query = self.find.text()
        if not query:
            self.found.setText("")
            return False
        flags = QTextDocument.FindFlag.FindBackward if backward else QTextDocument.FindFlag(0)
        if not self.text.find(query, flags):
            cursor = self.text.textCursor()
            cursor.movePosition(cursor.MoveOperation.End if backward else cursor.MoveOperation.Start)
            self.text.setTextCursor(cursor)
            if not self.text.find(query, flags):
                self.found.setText("not found")
                return False
        self.text.centerCursor()  # the match with the text around it
        self.found.setText("")
        return True
