"""The message box: Enter sends, Shift+Enter breaks the line; dropped or pasted files become attachments."""

from __future__ import annotations

from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import QPlainTextEdit


class Composer(QPlainTextEdit):
    submitted = Signal()
    files_dropped = Signal(list)  # local paths
    escape_pressed = Signal()
    edit_last_requested = Signal()  # Up in an empty box

    def __init__(self, parent=None):
        super().__init__(parent)
        self.setObjectName("composer")
        self.setPlaceholderText("Message the model…  (Enter sends, Shift+Enter for a new line)")
        self.setTabChangesFocus(True)
        self.setFixedHeight(76)

    def keyPressEvent(self, event) -> None:  # noqa: N802 - Qt override
        if event.key() in (Qt.Key.Key_Return, Qt.Key.Key_Enter):
            mods = event.modifiers()
            if mods & Qt.KeyboardModifier.ShiftModifier:
                self.insertPlainText("\n")
                return
            if not mods & (Qt.KeyboardModifier.ControlModifier | Qt.KeyboardModifier.AltModifier):
                self.submitted.emit()
                return
        if event.key() == Qt.Key.Key_Escape:
            self.escape_pressed.emit()
            return
        if event.key() == Qt.Key.Key_Up and not event.modifiers() and not self.toPlainText():
            self.edit_last_requested.emit()
            return
        super().keyPressEvent(event)

    # Files dropped on (or pasted into) the box are attachments, not text.
    def canInsertFromMimeData(self, source) -> bool:  # noqa: N802 - Qt override
        return source.hasUrls() or super().canInsertFromMimeData(source)

    def insertFromMimeData(self, source) -> None:  # noqa: N802 - Qt override
        paths = [url.toLocalFile() for url in source.urls() if url.isLocalFile()] if source.hasUrls() else []
        if paths:
            self.files_dropped.emit(paths)
            return
        super().insertFromMimeData(source)
