"""The chat transcript: one bubble per message, Markdown with code blocks (each with a copy link)."""

from __future__ import annotations

import html
import math
import re
import time

from PySide6.QtCore import QEvent, Qt, QUrl, Signal
from PySide6.QtGui import QColor, QFontDatabase, QGuiApplication, QTextCharFormat, QTextCursor, QTextFormat
from PySide6.QtWidgets import (
    QFrame,
    QHBoxLayout,
    QLabel,
    QPushButton,
    QScrollArea,
    QSizePolicy,
    QTextBrowser,
    QTextEdit,
    QVBoxLayout,
    QWidget,
)

from ..format import pages as page_count
from . import fit_to_text

_FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")
COPY_SCHEME = "copy"
DOCUMENT_SCHEME = "document"


def code_blocks(markdown: str) -> list[tuple[str, int, bool]]:
    """Fenced code blocks as (code, index of the closing line, closed?)."""
    blocks, lines = [], markdown.split("\n")
    opening, body = None, []
    for i, line in enumerate(lines):
        match = _FENCE.match(line)
        if opening is None:
            if match:
                opening, body = match.group(1), []
        elif match and match.group(1)[0] == opening[0] and len(match.group(1)) >= len(opening) \
                and not line.strip()[len(match.group(1)):].strip():
            blocks.append(("\n".join(body), i, True))
            opening = None
        else:
            body.append(line)
    if opening is not None:
        blocks.append(("\n".join(body), len(lines) - 1, False))
    return blocks


def with_copy_links(markdown: str) -> str:
    """Put a '❐ Copy code' link under every closed code block."""
    lines = markdown.split("\n")
    for index, (_, closing, closed) in reversed(list(enumerate(code_blocks(markdown)))):
        if closed:
            lines.insert(closing + 1, f"\n[❐ Copy code]({COPY_SCHEME}:{index})\n")
    return "\n".join(lines)


class MarkdownView(QTextBrowser):
    """A read-only text view as tall as its content (the transcript scrolls, not each bubble)."""

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.setVerticalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.setFrameShape(QFrame.Shape.NoFrame)
        self.setOpenLinks(False)
        self.setOpenExternalLinks(False)
        self.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Fixed)
        self.setTextInteractionFlags(Qt.TextInteractionFlag.TextBrowserInteraction)
        self.document().setDocumentMargin(2)
        self.document().documentLayout().documentSizeChanged.connect(self._fit)
        self.anchorClicked.connect(self._on_anchor)
        self._markdown = ""
        self.setFixedHeight(24)

    def set_markdown(self, text: str) -> None:
        self._markdown = text
        self.setMarkdown(with_copy_links(text))
        self._size_code()
        self._style_code_blocks()
        self._fit()

    def mark(self, query: str) -> int:
        """Shade every occurrence of `query` (ignoring case) in the text; '' clears. How many were found."""
        selections = []
        if query:
            shade = QTextCharFormat()
            shade.setBackground(QColor(self.palette().highlight().color()))
            shade.setForeground(QColor(self.palette().highlightedText().color()))
            cursor = self.document().find(query)
            while not cursor.isNull():
                selection = QTextEdit.ExtraSelection()
                selection.cursor, selection.format = cursor, shade
                selections.append(selection)
                cursor = self.document().find(query, cursor)
        self.setExtraSelections(selections)
        return len(selections)

    def _size_code(self) -> None:
        """Code (spans and blocks) at the text's size: the Markdown reader gives it the system's fixed font at that
        font's own size, which the app's text size would leave behind."""
        size = self.font().pointSizeF()
        if size <= 0 or size == QFontDatabase.systemFont(QFontDatabase.SystemFont.FixedFont).pointSizeF():
            return  # the reader's size already (the actual text size): nothing to walk on every streamed chunk
        code = []  # (start, end) of each fragment in the fixed font, collected before any is changed
        block = self.document().begin()
        while block.isValid():
            fragments = block.begin()
            while not fragments.atEnd():
                fragment = fragments.fragment()
                fmt = fragment.charFormat()
                if fmt.fontFixedPitch() or "monospace" in (fmt.fontFamilies() or []):
                    code.append((fragment.position(), fragment.position() + fragment.length()))
                fragments += 1
            block = block.next()
        sized = QTextCharFormat()
        sized.setFontPointSize(size)
        cursor = QTextCursor(self.document())
        for start, end in code:
            cursor.setPosition(start)
            cursor.setPosition(end, QTextCursor.MoveMode.KeepAnchor)
            cursor.mergeCharFormat(sized)

    def changeEvent(self, event) -> None:  # noqa: N802 - Qt override
        super().changeEvent(event)
        if event.type() == QEvent.Type.FontChange and self._markdown:
            self.set_markdown(self._markdown)  # the code's size follows the text's

    def set_plain(self, text: str) -> None:
        self._markdown = ""
        self.setPlainText(text)
        self._fit()

    def theme_changed(self) -> None:
        """The palette changed (light / dark): shade the code blocks with the new one (app.theme.apply calls it)."""
        self._style_code_blocks()

    def _style_code_blocks(self) -> None:
        """Shade fenced code and let long lines wrap (the bubble never scrolls sideways)."""
        doc = self.document()
        shade = QColor(self.palette().alternateBase().color())
        block = doc.begin()
        while block.isValid():
            fmt = block.blockFormat()
            if fmt.hasProperty(QTextFormat.Property.BlockCodeFence) or fmt.nonBreakableLines():
                fmt.setNonBreakableLines(False)
                fmt.setBackground(shade)
                cursor = QTextCursor(block)
                cursor.setBlockFormat(fmt)
            block = block.next()

    def _fit(self, *_args) -> None:
        height = math.ceil(self.document().size().height()) + 2 * self.frameWidth() + 2
        if height != self.height():
            self.setFixedHeight(height)

    def resizeEvent(self, event) -> None:  # noqa: N802 - Qt override
        super().resizeEvent(event)
        self._fit()

    def _on_anchor(self, url: QUrl) -> None:
        if url.scheme() == COPY_SCHEME:
            blocks = code_blocks(self._markdown)
            index = int(url.path() or 0)
            if 0 <= index < len(blocks):
                QGuiApplication.clipboard().setText(blocks[index][0])
        elif url.scheme() in ("http", "https", "mailto"):
            from PySide6.QtGui import QDesktopServices

            QDesktopServices.openUrl(url)


class MessageBubble(QFrame):
    """One message: who, the text, attachments, and (for replies) progress and the figures footer. Its header
    carries the message's actions: Copy, Edit (yours), Delete, and a reply's versions (‹ 2/3 ›)."""

    action_requested = Signal(str, int)  # "edit" | "delete" | "previous" | "next", the message id
    document_requested = Signal(int, int)  # the message id, the attachment's index: see its text

    def __init__(self, role: str, text: str = "", *, message_id: int | None = None, attachments=(),
                 footer: str = "", error: str | None = None, created: float | None = None,
                 parent: QWidget | None = None):
        super().__init__(parent)
        self.role, self.message_id = role, message_id
        self._version, self._actions_enabled = (1, 1), True
        self.setObjectName("userBubble" if role == "user" else "assistantBubble")
        self.setFrameShape(QFrame.Shape.StyledPanel)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(10, 6, 10, 6)
        layout.setSpacing(3)
        head = QHBoxLayout()
        who = QLabel("You" if role == "user" else "Assistant")
        who.setObjectName("bubbleRole")
        when = time.localtime(created if created is not None else time.time())
        who.setToolTip(("Sent " if role == "user" else "Answered ") + time.strftime("%Y-%m-%d %H:%M", when))
        self.role_label = who
        head.addWidget(who)
        head.addStretch(1)
        self.copy_button = QPushButton("Copy")
        self.copy_button.setObjectName("bubbleCopy")
        self.copy_button.setFlat(True)
        self.copy_button.setCursor(Qt.CursorShape.PointingHandCursor)
        self.copy_button.clicked.connect(self.copy_text)
        fit_to_text(self.copy_button, padding=12)
        self.previous_button = self._head_button("‹", "The previous version of this reply", "previous")
        self.version_label = QLabel("")
        self.version_label.setObjectName("bubbleVersion")
        self.next_button = self._head_button("›", "The next version of this reply", "next")
        for widget in (self.previous_button, self.version_label, self.next_button):
            widget.hide()
            head.addWidget(widget)
        self.edit_button = self._head_button("Edit", "Edit this message: the chat continues from it", "edit")
        self.edit_button.setVisible(role == "user" and message_id is not None)
        head.addWidget(self.edit_button)
        self.branch_button = self._head_button(
            "Branch", "A new chat with everything up to this reply, to ask something else from here", "branch")
        self.branch_button.setVisible(role == "assistant" and message_id is not None)
        head.addWidget(self.branch_button)
        head.addWidget(self.copy_button)
        self.delete_button = self._head_button(
            "Delete", "Delete this message and its reply" if role == "user" else "Delete this reply", "delete")
        self.delete_button.setVisible(message_id is not None)
        head.addWidget(self.delete_button)
        layout.addLayout(head)
        for index, info in enumerate(attachments):
            pages = f" · {page_count(info.pages)}" if info.pages else ""
            tokens = f" · ~{info.tokens:,} tokens" if info.tokens else ""
            chip = QLabel(f'❐ <a href="{DOCUMENT_SCHEME}:{index}">{html.escape(info.name)}</a>{pages} · '
                          f"{info.chars:,} chars{tokens}")
            chip.setTextFormat(Qt.TextFormat.RichText)
            chip.setToolTip("See the text the model read from this document")
            chip.linkActivated.connect(lambda link: self.document_requested.emit(
                self.message_id or 0, int(link.partition(":")[2])))
            chip.setObjectName("bubbleAttachment")
            chip.setWordWrap(True)  # never wider than the chat: a narrow window wraps it
            layout.addWidget(chip)
        self.progress = QLabel("")
        self.progress.setObjectName("bubbleProgress")
        self.progress.hide()
        layout.addWidget(self.progress)
        self.view = MarkdownView(self)
        layout.addWidget(self.view)
        self.error_label = QLabel("")
        self.error_label.setObjectName("bubbleError")
        self.error_label.setWordWrap(True)
        self.error_label.hide()
        layout.addWidget(self.error_label)
        self.footer = QLabel(footer)
        self.footer.setObjectName("bubbleFooter")
        self.footer.setWordWrap(True)
        self.footer.setVisible(bool(footer))
        layout.addWidget(self.footer)
        self.text = ""
        self.set_text(text)
        if error:
            self.set_error(error)

    def _head_button(self, text: str, tip: str, action: str) -> QPushButton:
        button = QPushButton(text)
        button.setObjectName("bubbleCopy")
        button.setFlat(True)
        button.setToolTip(tip)
        button.setCursor(Qt.CursorShape.PointingHandCursor)
        button.clicked.connect(lambda: self.action_requested.emit(action, self.message_id or 0))
        fit_to_text(button, padding=12)  # flat links, not 80-px buttons: a narrow chat keeps them all
        return button

    def set_versions(self, index: int, count: int) -> None:
        """Show '‹ index/count ›' (1-based) when the reply has more than one version."""
        self._version = (index, count)
        self.version_label.setText(f"{index}/{count}")
        for widget in (self.previous_button, self.version_label, self.next_button):
            widget.setVisible(count > 1)
        self.set_actions_enabled(self._actions_enabled)

    def set_actions_enabled(self, enabled: bool) -> None:
        """Off while a reply streams (the transcript must not change under it)."""
        self._actions_enabled = enabled
        index, count = self._version
        self.edit_button.setEnabled(enabled)
        self.branch_button.setEnabled(enabled)
        self.delete_button.setEnabled(enabled)
        self.previous_button.setEnabled(enabled and index > 1)
        self.next_button.setEnabled(enabled and index < count)

    def set_text(self, text: str) -> None:
        self.text = text
        if self.role == "user":
            self.view.set_plain(text)
        else:
            self.view.set_markdown(text)

    def append(self, chunk: str) -> None:
        self.progress.hide()
        self.set_text(self.text + chunk)

    def set_progress(self, message: str) -> None:
        self.progress.setText(message)
        self.progress.setVisible(bool(message))

    def set_footer(self, text: str) -> None:
        self.footer.setText(text)
        self.footer.setVisible(bool(text))

    def set_error(self, message: str) -> None:
        self.error_label.setText("⚠ " + message)
        self.error_label.setVisible(bool(message))

    def copy_text(self) -> None:
        QGuiApplication.clipboard().setText(self.text)


class ChatView(QScrollArea):
    """The transcript. Follows the newest text while the user is at the bottom."""

    message_action = Signal(str, int)  # a bubble's action (MessageBubble.action_requested)
    zoom_requested = Signal(int)  # Ctrl + the mouse wheel: +1 larger text, -1 smaller
    document_requested = Signal(int, int)  # a sent message's attachment (MessageBubble.document_requested)

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.setObjectName("chatView")
        self.setWidgetResizable(True)
        self.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self._inner = QWidget()
        self._inner.setObjectName("chatInner")
        self._layout = QVBoxLayout(self._inner)
        self._layout.setContentsMargins(12, 12, 12, 12)
        self._layout.setSpacing(10)
        self._placeholder = QLabel("Ask anything, or drop a PDF, Word, Markdown or source file here "
                                   "and ask about it.")
        self._placeholder.setObjectName("chatPlaceholder")
        self._placeholder.setAlignment(Qt.AlignmentFlag.AlignCenter)
        self._placeholder.setWordWrap(True)
        self._layout.addWidget(self._placeholder)
        self._layout.addStretch(1)
        self.setWidget(self._inner)
        self.bubbles: list[MessageBubble] = []
        self._follow = True
        bar = self.verticalScrollBar()
        bar.valueChanged.connect(self._on_scrolled)
        bar.rangeChanged.connect(self._on_range)
        # a message a search found, kept in sight while the transcript lays out, until the user scrolls or the chat
        # changes
        self._target: MessageBubble | None = None
        bar.actionTriggered.connect(self._forget_target)

    def wheelEvent(self, event) -> None:  # noqa: N802 - Qt override
        """Ctrl + the wheel changes the text size, as in a browser; the wheel alone scrolls."""
        if event.modifiers() & Qt.KeyboardModifier.ControlModifier and event.angleDelta().y():
            self.zoom_requested.emit(1 if event.angleDelta().y() > 0 else -1)
            event.accept()
            return
        super().wheelEvent(event)

    def _forget_target(self, *_args) -> None:
        self._target = None

    def clear(self) -> None:
        self._target = None
        for bubble in self.bubbles:
            self._layout.removeWidget(bubble)
            bubble.hide()  # at once: the deletion waits for the event loop
            bubble.deleteLater()
        self.bubbles.clear()
        self._placeholder.show()
        self._follow = True

    def add(self, bubble: MessageBubble) -> MessageBubble:
        self._target = None
        bubble.action_requested.connect(self.message_action)
        bubble.document_requested.connect(self.document_requested)
        self._placeholder.hide()
        self._layout.insertWidget(self._layout.count() - 1, bubble)
        self.bubbles.append(bubble)
        self._follow = True
        return bubble

    def remove(self, bubble: MessageBubble) -> None:
        if bubble in self.bubbles:
            self.bubbles.remove(bubble)
            self._layout.removeWidget(bubble)
            bubble.hide()  # at once: the deletion waits for the event loop
            bubble.deleteLater()
        self._placeholder.setVisible(not self.bubbles)

    def highlight(self, query: str) -> MessageBubble | None:
        """Mark every occurrence of `query` (ignoring case) in the messages, as the chats list's search found it, and
        scroll to the first message holding it; '' clears the marks. The first bubble found, or None."""
        first = None
        for bubble in self.bubbles:
            if bubble.view.mark(query) and first is None:
                first = bubble
        self._target = first
        if first is not None:
            self._follow = False  # stay on the match as the transcript lays out (_on_range)
            self._show_target()
        return first

    def _show_target(self) -> None:
        if self._target is not None and self._target in self.bubbles:  # near the top, what follows it below
            self.verticalScrollBar().setValue(max(0, self._target.y() - 40))

    def _on_scrolled(self, value: int) -> None:
        bar = self.verticalScrollBar()
        self._follow = value >= bar.maximum() - 40

    def _on_range(self, _minimum: int, maximum: int) -> None:
        if self._target is not None:
            self._show_target()
        elif self._follow:
            self.verticalScrollBar().setValue(maximum)
