"""The chat's system prompt: a one-line summary above the chat that opens an editor, and "use for new chats"."""

from __future__ import annotations

from PySide6.QtCore import QTimer, Signal
from PySide6.QtWidgets import QHBoxLayout, QPlainTextEdit, QPushButton, QToolButton, QVBoxLayout, QWidget

DEBOUNCE_MS = 500
SUMMARY_CHARS = 70


class SystemPromptBox(QWidget):
    changed = Signal(str)  # debounced: the chat's system prompt ('' for none)
    make_default = Signal(str)  # the user wants new chats to start with this prompt

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.setObjectName("systemPrompt")
        layout = QVBoxLayout(self)
        layout.setContentsMargins(8, 4, 8, 0)
        layout.setSpacing(2)
        self.toggle = QToolButton()
        self.toggle.setObjectName("systemPromptToggle")
        self.toggle.setCheckable(True)
        self.toggle.setAutoRaise(True)
        self.toggle.setToolTip("The instructions the model reads before this chat (a change re-reads the chat)")
        self.toggle.toggled.connect(self._show_editor)
        layout.addWidget(self.toggle)
        self.editor = QPlainTextEdit()
        self.editor.setObjectName("systemPromptEditor")
        self.editor.setPlaceholderText("e.g. “You are a concise assistant. Answer from the attached documents.”")
        self.editor.setFixedHeight(64)
        self.editor.textChanged.connect(self._edited)
        self.default_button = QPushButton("Use for new chats")
        self.default_button.setToolTip("New chats start with this system prompt")
        self.default_button.clicked.connect(lambda: self.make_default.emit(self.text()))
        row = QHBoxLayout()
        row.setContentsMargins(0, 0, 0, 0)
        row.addWidget(self.editor, 1)
        row.addWidget(self.default_button)
        self.editor_row = QWidget()
        self.editor_row.setLayout(row)
        self.editor_row.hide()
        layout.addWidget(self.editor_row)
        self._debounce = QTimer(self, singleShot=True, interval=DEBOUNCE_MS)
        self._debounce.timeout.connect(lambda: self.changed.emit(self.text()))
        self._quiet = False
        self._summarise()

    def text(self) -> str:
        return self.editor.toPlainText().strip()

    def set_text(self, text: str) -> None:
        """Show a chat's prompt (no `changed` signal: nothing was edited)."""
        self._debounce.stop()
        self._quiet = True
        self.editor.setPlainText(text or "")
        self._quiet = False
        self._summarise()

    def flush(self) -> None:
        """Emit a pending edit now (before the chat changes or a message is sent)."""
        if self._debounce.isActive():
            self._debounce.stop()
            self.changed.emit(self.text())

    def _edited(self) -> None:
        self._summarise()
        if not self._quiet:
            self._debounce.start()

    def _show_editor(self, shown: bool) -> None:
        self.editor_row.setVisible(shown)
        self._summarise()
        if shown:
            self.editor.setFocus()

    def _summarise(self) -> None:
        text = " ".join(self.text().split())
        if len(text) > SUMMARY_CHARS:
            text = text[: SUMMARY_CHARS - 1] + "…"
        arrow = "▾" if self.toggle.isChecked() else "▸"
        self.toggle.setText(f"{arrow} System prompt: {text or 'none'}")
