"""The text the model reads of an attached document: what the reader extracted from the PDF, Word file or web page
(columns, tables and headings as the reader laid them out), with its figures and the reader's notes, and a find
box. Opened from a document's chip before sending and from a sent message's attachment.

Once the chat has read the document, the text is tinted by what the cache holds of it now (engine.heat): each
token by the share of the cache's layers and heads that hold it hot (attended at every step); the rest is in the cold tier
(or discarded with the tier off). It follows each turn and each change of the cache's knobs."""

from __future__ import annotations

import bisect

from PySide6.QtCore import QEvent, QObject, QPoint, Qt, Signal
from PySide6.QtGui import QKeySequence, QPainter, QShortcut, QTextCharFormat, QTextCursor, QTextDocument
from PySide6.QtWidgets import (
    QCheckBox,
    QDialog,
    QDialogButtonBox,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QPlainTextEdit,
    QPushButton,
    QToolTip,
    QVBoxLayout,
    QWidget,
)

from .. import theme
from ..format import pages as page_count

HEAT_EDGES = (0.1, 0.5, 0.9)  # a token's share of the layers' heads that hold it hot: the tint's three levels
NO_HEAT = {  # why there is no tint (EngineWorker.report_heat)
    "not_held": "What the cache holds of this text shows here once the chat has read it (send it with a question).",
    "not_loaded": "This chat's cache is loaded when you next ask it something (from its saved copy where there is "
                  "one); what it holds of this text shows here then.",
    "no_model": "What the cache holds of this text shows here once a model is loaded and the chat has read it.",
    "remote": "The model runs on a server other than DS-V4.1's: its cache is not visible from here.",
}
WHERE_COLD = {"ram": "The rest is in the cold tier in RAM: a question brings back what it needs.",
              "disk": "The rest is in the cold tier on disk: a question brings back what it needs.",
              "off": "The rest was discarded by compaction (the cold tier is off)."}


def describe(document) -> str:
    """'PDF · 6 pages · 21,530 chars' and the reader's notes, one per line."""
    parts = [document.kind.upper() if document.kind in ("pdf", "docx") else document.kind]
    if document.pages:
        parts.append(page_count(document.pages))
    parts.append(f"{document.chars:,} chars")
    return "\n".join([" · ".join(parts), *(f"ⓘ {note}" for note in getattr(document, "notes", ()) or ())])


class DocumentTextDialog(QDialog):
    pin_requested = Signal(str)  # the selected text, to keep hot
    unpin_requested = Signal()

    def __init__(self, document, parent: QWidget | None = None, conversation_id: int | None = None):
        super().__init__(parent)
        self.document_text = document.text
        self.conversation_id = conversation_id  # the chat whose cache the tint shows (None: none)
        self.setWindowTitle(f"{document.name} — the text the model reads")
        self.setAttribute(Qt.WidgetAttribute.WA_DeleteOnClose)
        self.resize(760, 640)
        layout = QVBoxLayout(self)
        self.figures = QLabel(describe(document))
        self.figures.setObjectName("dimLabel")
        self.figures.setWordWrap(True)
        layout.addWidget(self.figures)
        heat_row = QHBoxLayout()
        self.heat_label = QLabel("")
        self.heat_label.setObjectName("dimLabel")
        self.heat_label.setWordWrap(True)
        self.heat_label.setTextFormat(Qt.TextFormat.RichText)
        heat_row.addWidget(self.heat_label, 1)
        self.tint = QCheckBox("Tint")
        self.tint.setToolTip("Tint the text by what the cache holds hot now")
        self.tint.setChecked(True)
        self.tint.toggled.connect(self._paint_heat)
        self.tint.setVisible(False)
        heat_row.addWidget(self.tint, 0, Qt.AlignmentFlag.AlignTop)
        layout.addLayout(heat_row)
        pin_row = QHBoxLayout()
        self.keep_hot = QPushButton("Keep selection hot")
        self.keep_hot.setToolTip("Keep the selected text in the hot set: questions about other parts do not push it "
                                 "out (up to half of the hot set)")
        self.keep_hot.setVisible(False)  # once the engine has said the chat's cache holds this text
        self.keep_hot.clicked.connect(self._keep_selection)
        pin_row.addWidget(self.keep_hot)
        self.pins_label = QLabel("")
        self.pins_label.setObjectName("dimLabel")
        pin_row.addWidget(self.pins_label, 1)
        self.unpin = QPushButton("Unpin all")
        self.unpin.setToolTip("Let the cache decide again what of this chat's documents stays hot")
        self.unpin.clicked.connect(self.unpin_requested)
        self.unpin.setVisible(False)
        pin_row.addWidget(self.unpin)
        layout.addLayout(pin_row)
        self.pins: list[str] = []  # the chat's pieces kept hot (all its documents')
        self.heat = None  # engine.heat.DocumentHeat, once the engine has said
        self._why = ""
        self._starts: list[int] = []  # each span's start, for the tooltip's lookup
        self.text = QPlainTextEdit()
        self.text.setReadOnly(True)
        self.text.setUndoRedoEnabled(False)  # the tint is written into the text's formats, never to be undone
        self.text.setPlainText(document.text)
        self.text.selectionChanged.connect(self._update_keep_hot)
        self._units = _utf16_offsets(document.text)
        self._tips = _HeatTips(self)
        self.text.viewport().installEventFilter(self._tips)
        text_row = QHBoxLayout()
        text_row.setSpacing(4)
        text_row.addWidget(self.text, 1)
        self.strip = HeatStrip(self)
        self.strip.setVisible(False)
        self.text.verticalScrollBar().valueChanged.connect(self.strip.update)
        text_row.addWidget(self.strip)
        layout.addLayout(text_row, 1)
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

    # ------------------------------------------------------------------ what the cache holds
    def show_heat(self, heat, why: str = "not_held") -> None:
        """The engine's DocumentHeat for this text, or None and why (EngineWorker.report_heat)."""
        self.heat = heat
        self._why = why
        self._starts = [start for start, _, _ in heat.spans] if heat is not None else []
        self.tint.setVisible(heat is not None)
        self.strip.show_heat(heat)
        self._update_keep_hot()
        self._say_pins()
        if heat is None:
            self.heat_label.setText(NO_HEAT.get(why, NO_HEAT["not_held"]))
        else:
            self.heat_label.setText(
                f"Held hot now: {heat.hot_share:.0%} of its {heat.tokens:,} tokens (the hot set: attended at "
                f"every step; cache ratio {heat.ratio:.2f}). {WHERE_COLD.get(heat.cold_tier, '')}<br>"
                + " ".join(_swatch(f"heat_{level}", text) for level, text in
                           ((3, "hot in ≥ 90 % of the layers' heads"), (2, "50–90 %"), (1, "10–50 %")))
                + " untinted: cold")
        self._paint_heat()

    def set_pins(self, pins) -> None:
        """The chat's pieces kept hot: those in this text underlined, their count said."""
        self.pins = list(pins)
        self._say_pins()
        self.unpin.setVisible(bool(self.pins))
        self._paint_heat()

    def _say_pins(self) -> None:
        """'Kept hot: 2 parts of this text', and how many of them the engine's heat shows not wholly hot (a tighter
        ratio than they were pinned at has no room for the later ones)."""
        if not self.pins:
            self.pins_label.setText("")
            return
        here = [pin for pin in self.pins if pin in self.document_text]
        text = f"Kept hot: {len(here)} part{'s' if len(here) != 1 else ''} of this text"
        if len(self.pins) > len(here):
            text += f" ({len(self.pins) - len(here)} in other documents)"
        cold = sum(1 for pin in here if not self._wholly_hot(pin))
        if self.heat is not None and cold:
            text += (f"; {cold} not wholly hot at cache ratio {self.heat.ratio:.2f}: raise the ratio, or unpin "
                     "to let the cache choose")
        self.pins_label.setText(text)

    def _wholly_hot(self, pin: str) -> bool:
        """Every token of the piece (its last occurrence, where the engine keeps it) hot in every head."""
        if self.heat is None:
            return True
        at = self.document_text.rfind(pin)
        end = at + len(pin)
        return all(share >= 0.999 for start, stop, share in self.heat.spans if start < end and stop > at)

    def selected_text(self) -> str:
        """The selection as plain text (Qt gives paragraph ends as U+2029)."""
        return self.text.textCursor().selectedText().replace("\u2029", "\n").strip()

    def _keep_selection(self) -> None:
        if self.selected_text():
            self.pin_requested.emit(self.selected_text())

    def _update_keep_hot(self) -> None:
        """Pinning needs a chat that has read this text (or whose cache loads at its next turn), and a selection."""
        can = self.heat is not None or self._why == "not_loaded"
        self.keep_hot.setVisible(can)
        self.keep_hot.setEnabled(can and bool(self.selected_text()))

    def changeEvent(self, event) -> None:  # noqa: N802 - Qt's name
        """A theme change: the tints and the legend in the new theme's colours."""
        super().changeEvent(event)
        if event.type() in (QEvent.Type.PaletteChange, QEvent.Type.StyleChange) and self.heat is not None:
            self.show_heat(self.heat, self._why)
        elif event.type() in (QEvent.Type.PaletteChange, QEvent.Type.StyleChange) and self.pins:
            self._paint_heat()

    def _paint_heat(self) -> None:
        """The tint and the pins' underlines as the text's own character formats: laid out once, so scrolling and
        painting cost what the view shows (extra selections are walked on every paint: a scroll of a 40k-token
        worst case took 6.8 s with them, 23 ms this way after a 0.4 s tint; benchmarks/document_heat.py)."""
        document = self.text.document()
        cursor = QTextCursor(document)
        cursor.beginEditBlock()
        cursor.select(QTextCursor.SelectionType.Document)
        cursor.setCharFormat(QTextCharFormat())
        if self.heat is not None and self.tint.isChecked():
            formats = {}
            for level in range(1, len(HEAT_EDGES) + 1):
                formats[level] = QTextCharFormat()
                formats[level].setBackground(theme.color(f"heat_{level}"))
            for start, end, level in self.heat.levels(HEAT_EDGES):
                if level:  # a tint across a line's end would also mark the empty line after a paragraph
                    for line_start, line_end in _lines(self.document_text, start, end):
                        self._format(cursor, line_start, line_end, formats[level])
        underline = QTextCharFormat()
        underline.setFontUnderline(True)
        underline.setUnderlineColor(theme.color("accent"))
        for pin in self.pins:  # where the engine keeps it: its last occurrence in the text
            at = self.document_text.rfind(pin)
            if at >= 0:
                self._format(cursor, at, at + len(pin), underline)
        cursor.endEditBlock()
        self.strip.setVisible(self.heat is not None and self.tint.isChecked())

    def _format(self, cursor: QTextCursor, start: int, end: int, char_format: QTextCharFormat) -> None:
        cursor.setPosition(self._unit(start))
        cursor.setPosition(self._unit(end), QTextCursor.MoveMode.KeepAnchor)
        cursor.mergeCharFormat(char_format)

    def tints(self) -> list[tuple[int, int, str, bool]]:
        """What the text shows: (start, end, background colour, underlined) of each piece formatted (Qt's offsets)."""
        out = []
        block = self.text.document().begin()
        while block.isValid():
            it = block.begin()
            while not it.atEnd():
                fragment = it.fragment()
                fmt = fragment.charFormat()
                if fmt.hasProperty(QTextCharFormat.Property.BackgroundBrush) or fmt.fontUnderline():
                    colour = fmt.background().color().name() if fmt.hasProperty(
                        QTextCharFormat.Property.BackgroundBrush) else ""
                    out.append((fragment.position(), fragment.position() + fragment.length(), colour,
                                fmt.fontUnderline()))
                it += 1
            block = block.next()
        return out

    def _char(self, unit: int) -> int:
        """The inverse of _unit: the character at UTF-16 offset `unit`."""
        return bisect.bisect_right(self._units, unit) - 1 if self._units else unit

    def _unit(self, offset: int) -> int:
        """A character offset of the text as Qt counts it (UTF-16 units: a character past U+FFFF is two)."""
        units = self._units
        return units[min(offset, len(units) - 1)] if units else min(offset, len(self.document_text))

    def visible_chars(self) -> tuple[int, int]:
        """The characters of the text shown in the view, first and last."""
        viewport = self.text.viewport()
        first = self.text.cursorForPosition(QPoint(0, 0)).position()
        last = self.text.cursorForPosition(QPoint(viewport.width() - 1, viewport.height() - 1)).position()
        return self._char(first), self._char(last)

    def go_to(self, char: int) -> None:
        """Scroll the view to the character `char` of the text (the strip's click)."""
        cursor = self.text.textCursor()
        cursor.setPosition(self._unit(max(char, 0)))
        self.text.setTextCursor(cursor)
        self.text.centerCursor()

    def share_at(self, position: int) -> float | None:
        """The hot share of the token at character `position` of the text (None outside any or without heat)."""
        if self.heat is None or not self._starts:
            return None
        i = bisect.bisect_right(self._starts, position) - 1
        if i < 0:
            return None
        start, end, share = self.heat.spans[i]
        return share if start <= position < end else None


def _lines(text: str, start: int, end: int):
    """The pieces of text[start:end] between its line breaks that hold more than white space, as (start, end)."""
    at = start
    while at < end:
        cut = text.find("\n", at, end)
        stop = end if cut < 0 else cut
        if text[at:stop].strip():
            yield at, stop
        at = stop + 1


def _utf16_offsets(text: str) -> list[int]:
    """For each character offset 0..len(text), its offset in UTF-16 units; [] when they are the same."""
    if all(ord(c) <= 0xFFFF for c in text):
        return []
    offsets, unit = [], 0
    for c in text:
        offsets.append(unit)
        unit += 2 if ord(c) > 0xFFFF else 1
    offsets.append(unit)
    return offsets


def _swatch(color: str, text: str) -> str:
    return (f'<span style="background-color:{theme.colors()[color]}; color:{theme.colors()["text"]}">'
            f"&nbsp;{text}&nbsp;</span>")


class HeatStrip(QWidget):
    """Beside the text, the whole document at a glance: each row the tint of its part of the text (by characters),
    the part in view framed; a click goes there."""

    WIDTH = 14

    def __init__(self, dialog: DocumentTextDialog):
        super().__init__(dialog)
        self.dialog = dialog
        self.setFixedWidth(self.WIDTH)
        self.setToolTip("The whole text by what the cache holds hot; click to go there")
        self.heat = None
        self._rows: tuple[int, list[int]] = (0, [])  # the levels painted last, for their height (a scroll repaints)

    def show_heat(self, heat) -> None:
        self.heat, self._rows = heat, (0, [])
        self.update()

    def row_levels(self, rows: int) -> list[int]:
        """The tint level of each of `rows` rows (DocumentHeat.profile: each row's part of the text)."""
        if self.heat is None:
            return [0] * rows
        if self._rows[0] != rows:
            profile = self.heat.profile(len(self.dialog.document_text), rows)
            self._rows = (rows, [sum(share >= edge for edge in HEAT_EDGES) for share in profile])
        return self._rows[1]

    def paintEvent(self, event) -> None:  # noqa: N802 - Qt's name
        painter = QPainter(self)
        height = self.height()
        painter.fillRect(self.rect(), theme.color("bar_track"))
        for y, level in enumerate(self.row_levels(height)):
            if level:
                painter.fillRect(0, y, self.width(), 1, theme.color(f"heat_{level}"))
        length = max(len(self.dialog.document_text), 1)
        first, last = self.dialog.visible_chars()
        top, bottom = int(first / length * height), int(last / length * height)
        painter.setPen(theme.color("accent"))
        painter.drawRect(0, top, self.width() - 1, max(bottom - top, 2))
        painter.end()

    def mousePressEvent(self, event) -> None:  # noqa: N802 - Qt's name
        self._go(event.position().y())

    def mouseMoveEvent(self, event) -> None:  # noqa: N802 - Qt's name
        if event.buttons() & Qt.MouseButton.LeftButton:
            self._go(event.position().y())

    def _go(self, y: float) -> None:
        share = min(max(y / max(self.height(), 1), 0.0), 1.0)
        self.dialog.go_to(int(share * len(self.dialog.document_text)))
        self.update()


class _HeatTips(QObject):
    """Over the tinted text, a token's share as a tooltip."""

    def __init__(self, dialog: DocumentTextDialog):
        super().__init__(dialog)
        self.dialog = dialog

    def eventFilter(self, watched, event) -> bool:  # noqa: N802 - Qt's name
        if event.type() == QEvent.Type.ToolTip and self.dialog.heat is not None:
            cursor = self.dialog.text.cursorForPosition(event.pos())
            position = self.dialog._char(cursor.position())
            share = self.dialog.share_at(position)
            if share is not None:
                QToolTip.showText(event.globalPos(), f"held hot in {share:.0%} of the cache's layers' heads")
            else:
                QToolTip.hideText()
            return True
        return False
