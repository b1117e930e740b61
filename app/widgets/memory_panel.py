"""Live memory: a stacked bar (weights / KV / activations / other / free), the KV line, a timeline of KV and
total across the turn, and the context bar (system / history / documents / prompt against max_seq_len)."""

from __future__ import annotations

import time
from collections import deque

from PySide6.QtCore import QEvent, QPointF, QRectF, Qt
from PySide6.QtGui import QColor, QFont, QFontMetrics, QPainter, QPainterPath, QPen
from PySide6.QtWidgets import QGridLayout, QGroupBox, QLabel, QSizePolicy, QVBoxLayout, QWidget

from .. import theme
from ..format import fmt_bytes, kv_line, ratio_line

MEMORY_COLORS = {
    "Weights": "#4e79a7", "KV cache": "#f28e2b", "Activations": "#59a14f", "Other": "#9d8f8a", "Free": "#dfe3e8",
}
CONTEXT_COLORS = {
    "System": "#9c755f", "History": "#4e79a7", "Documents": "#f28e2b", "Prompt": "#59a14f", "Free": "#dfe3e8",
}
TIMELINE_SECONDS = 180


class StackedBar(QWidget):
    """Horizontal bar of segments proportional to their values; tiny non-zero segments stay visible."""

    def __init__(self, colors: dict[str, str], parent: QWidget | None = None):
        super().__init__(parent)
        self.colors = colors
        self.segments: list[tuple[str, float]] = []
        self.setMinimumHeight(18)
        self.setMaximumHeight(22)
        self.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Fixed)

    def set_segments(self, segments: list[tuple[str, float]]) -> None:
        self.segments = [(name, max(float(value), 0.0)) for name, value in segments]
        self.setToolTip("\n".join(f"{name}: {value:,.0f}" for name, value in self.segments))
        self.update()

    def paintEvent(self, _event) -> None:  # noqa: N802 - Qt override
        painter = QPainter(self)
        painter.setRenderHint(QPainter.RenderHint.Antialiasing)
        rect = QRectF(self.rect()).adjusted(0.5, 0.5, -0.5, -0.5)
        path = QPainterPath()
        path.addRoundedRect(rect, 4, 4)
        painter.setClipPath(path)
        painter.fillRect(rect, theme.color("bar_track"))
        total = sum(v for _, v in self.segments)
        if total > 0:
            widths = [max(rect.width() * v / total, 2.0) if v > 0 else 0.0 for _, v in self.segments]
            scale = rect.width() / sum(widths) if sum(widths) else 1.0
            x = rect.left()
            for (name, _), width in zip(self.segments, widths, strict=False):
                w = width * scale
                fill = theme.color("free") if name == "Free" else QColor(self.colors.get(name, "#888"))
                painter.fillRect(QRectF(x, rect.top(), w, rect.height()), fill)
                x += w
        painter.setClipping(False)
        painter.setPen(QPen(theme.color("bar_outline")))
        painter.drawPath(path)


class Timeline(QWidget):
    """KV stored and total engine memory over the last few minutes."""

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.samples: deque[tuple[float, int, int]] = deque(maxlen=600)
        self._fit_to_font()
        self.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Fixed)
        self.setToolTip("KV cache (orange) and total engine memory (blue) over the last 3 minutes")

    def _label_font(self) -> QFont:
        """The axis labels' font: a little smaller than the widget's."""
        font = QFont(self.font())
        font.setPointSizeF(max(font.pointSizeF() - 1.5, 6.5))
        return font

    def _fit_to_font(self) -> None:
        """The plot keeps its height, the labels under it the height their font needs (the text size changes it)."""
        self._label_height = QFontMetrics(self._label_font()).height()
        self.setMinimumHeight(44 + self._label_height)
        self.setMaximumHeight(58 + self._label_height)

    def changeEvent(self, event) -> None:  # noqa: N802 - Qt override
        if event.type() == QEvent.Type.FontChange:
            self._fit_to_font()
        super().changeEvent(event)

    def add(self, kv: int, total: int, when: float | None = None) -> None:
        self.samples.append((when if when is not None else time.monotonic(), kv, total))
        self.update()

    def paintEvent(self, _event) -> None:  # noqa: N802 - Qt override
        painter = QPainter(self)
        painter.setRenderHint(QPainter.RenderHint.Antialiasing)
        rect = QRectF(self.rect()).adjusted(1, 1, -1, -1 - self._label_height)
        painter.fillRect(QRectF(self.rect()), theme.color("plot"))
        painter.setPen(QPen(theme.color("plot_grid")))
        painter.drawRect(rect)
        if not self.samples:
            painter.setPen(theme.color("plot_text"))
            painter.drawText(rect, Qt.AlignmentFlag.AlignCenter, "no samples yet")
            return
        now = self.samples[-1][0]
        start = now - TIMELINE_SECONDS
        peak = max(max(s[2] for s in self.samples), max(s[1] for s in self.samples), 1)
        for index, color in ((2, "#4e79a7"), (1, "#f28e2b")):
            path = QPainterPath()
            first = True
            for when, *values in self.samples:
                if when < start:
                    continue
                x = rect.left() + rect.width() * (when - start) / TIMELINE_SECONDS
                y = rect.bottom() - rect.height() * values[index - 1] / peak
                if first:
                    path.moveTo(QPointF(x, y))
                    first = False
                else:
                    path.lineTo(QPointF(x, y))
            painter.setPen(QPen(QColor(color), 1.6))
            painter.drawPath(path)
        painter.setPen(theme.color("plot_text"))
        painter.setFont(self._label_font())
        labels = QRectF(rect.left(), rect.bottom() + 1, rect.width(), self._label_height)
        painter.drawText(labels, Qt.AlignmentFlag.AlignLeft, f"−{TIMELINE_SECONDS // 60} min")
        painter.drawText(labels, Qt.AlignmentFlag.AlignRight, f"peak {fmt_bytes(peak)}")


class TwoLineLabel(QLabel):
    """A wrapping label two lines of its own font tall, empty or not (so what is below never jumps), at any text
    size."""

    def __init__(self, parent: QWidget | None = None):
        super().__init__("", parent)
        self._fit_to_font()

    def _fit_to_font(self) -> None:
        self.setFixedHeight(2 * self.fontMetrics().lineSpacing() + 2)

    def changeEvent(self, event) -> None:  # noqa: N802 - Qt override
        if event.type() == QEvent.Type.FontChange:
            self._fit_to_font()
        super().changeEvent(event)


def _legend(color: str, text: str) -> QLabel:
    label = QLabel(f'<span style="color:{color}">■</span> {text}')
    label.setTextFormat(Qt.TextFormat.RichText)
    return label


class MemoryPanel(QGroupBox):
    def __init__(self, parent: QWidget | None = None):
        super().__init__("Memory", parent)
        self.setObjectName("memoryPanel")
        layout = QVBoxLayout(self)
        layout.setSpacing(4)
        self.device_label = QLabel("No model loaded")
        self.device_label.setObjectName("deviceLabel")
        self.device_label.setWordWrap(True)  # a remote server's address and device: wrap, never widen the panel
        layout.addWidget(self.device_label)
        self.bar = StackedBar(MEMORY_COLORS)
        layout.addWidget(self.bar)
        grid = QGridLayout()
        grid.setHorizontalSpacing(8)
        grid.setVerticalSpacing(1)
        self.values: dict[str, QLabel] = {}
        for row, name in enumerate(MEMORY_COLORS):
            grid.addWidget(_legend(MEMORY_COLORS[name], name), row, 0)
            value = QLabel("—")
            value.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
            value.setWordWrap(True)  # "KV cache" carries the cold tier and the last recall: wrap, never cut
            grid.addWidget(value, row, 1)
            self.values[name] = value
        grid.setColumnStretch(1, 1)
        layout.addLayout(grid)
        self.tokens_label = QLabel("")
        self.tokens_label.setObjectName("dimLabel")
        self.tokens_label.setWordWrap(True)
        layout.addWidget(self.tokens_label)
        # The compression line and the warning keep their room (two lines each) whether or not they have
        # anything to say, so the panel below never jumps when a warning comes or goes
        self.ratio_label = TwoLineLabel()
        self.ratio_label.setObjectName("dimLabel")
        self.ratio_label.setWordWrap(True)
        layout.addWidget(self.ratio_label)
        self.hint_label = TwoLineLabel()
        self.hint_label.setObjectName("hintLabel")
        self.hint_label.setWordWrap(True)
        layout.addWidget(self.hint_label)
        self.timeline = Timeline()
        layout.addWidget(self.timeline)
        layout.addSpacing(4)
        self.context_title = QLabel("Context")
        self.context_title.setObjectName("sectionLabel")
        layout.addWidget(self.context_title)
        self.context_bar = StackedBar(CONTEXT_COLORS)
        layout.addWidget(self.context_bar)
        self.context_label = QLabel("—")
        self.context_label.setWordWrap(True)
        self.context_label.setTextFormat(Qt.TextFormat.RichText)
        layout.addWidget(self.context_label)
        self.report = None

    def show_report(self, report) -> None:
        self.report = report
        remote = report.remote
        if remote and not report.total:  # a server that reports nothing about its memory: say so, show nothing
            self.device_label.setText(f"Remote · {report.device_label}")
            self.device_label.setToolTip(f"The model runs at {remote}. An OpenAI-compatible server tells nothing "
                                         "about its memory; DS-V4.1's own server (python -m engine serve) does.")
            self.bar.set_segments([])
            for value in self.values.values():
                value.setText("remote: not reported")
            self.tokens_label.setText("")
            self.ratio_label.setText("")
            self.hint_label.setText("")
            if self.hint_label.property("active"):
                self.hint_label.setProperty("active", False)
                self.hint_label.style().unpolish(self.hint_label)
                self.hint_label.style().polish(self.hint_label)
            return
        is_cpu = str(report.device).startswith("cpu")
        used = report.used_by_engine
        place = "CPU · system RAM" if is_cpu else f"GPU · {report.device_label}"
        if remote:
            place = f"Remote · {report.device_label}"
        self.device_label.setText(f"{place} · {fmt_bytes(report.total)} total")
        self.device_label.setToolTip(f"Figures reported by the DS-V4.1 server at {remote}" if remote else "")
        self.bar.set_segments([("Weights", report.weights), ("KV cache", report.kv_stored),
                               ("Activations", report.activations), ("Other", report.other),
                               ("Free", report.free)])
        self.values["Weights"].setText(fmt_bytes(report.weights))
        kv = kv_line(report.kv_stored, report.kv_uncompressed)
        disk = report.kv_cold_disk
        if report.kv_cold or disk:  # entries out of the hot set, kept for later questions to recall
            kv += f" · cold tier {fmt_bytes(report.kv_cold)} RAM" + (f" + {fmt_bytes(disk)} disk" if disk else "")
            if report.recall_s is not None:
                kv += f", last recall {report.recall_s * 1000:.0f} ms"
        self.values["KV cache"].setText(kv)
        self.values["Activations"].setText(fmt_bytes(report.activations))
        other = "other processes" if is_cpu else "reserved + other processes"
        self.values["Other"].setText(f"{fmt_bytes(report.other)} ({other})")
        self.values["Free"].setText(f"{fmt_bytes(report.free)} · engine uses {fmt_bytes(used)}")
        saved = report.saved_caches
        self.tokens_label.setText(f"{report.tokens_seen:,} tokens seen · {report.kv_stored_tokens:,} entries stored"
                                  + (f" · saved chat caches {fmt_bytes(saved)} on disk" if saved else ""))
        line = ratio_line(report)
        self.ratio_label.setText(line.split("; ")[0])  # its first reason fits the two lines kept for it
        self.ratio_label.setToolTip(line)
        hint, short = report.hint(), report.short_hint()
        self.hint_label.setText(("⚠ " + short) if short else "")
        self.hint_label.setToolTip(hint or "")
        if self.hint_label.property("active") != bool(short):  # the yellow box only around a warning
            self.hint_label.setProperty("active", bool(short))
            self.hint_label.style().unpolish(self.hint_label)
            self.hint_label.style().polish(self.hint_label)
        self.timeline.add(report.kv_stored, used)

    def show_context(self, figures) -> None:
        free = max(figures.limit - figures.total, 0)
        self.context_bar.set_segments([("System", figures.system), ("History", figures.history),
                                       ("Documents", figures.documents), ("Prompt", figures.prompt),
                                       ("Free", free)])
        parts = [("System", figures.system), ("History", figures.history), ("Documents", figures.documents),
                 ("Prompt", figures.prompt)]
        text = " ".join(f'<span style="color:{CONTEXT_COLORS[n]}">■</span> {n.lower()} {v:,}' for n, v in parts)
        over = figures.total >= figures.limit
        total = f"{figures.total:,} / {figures.limit:,} tokens (max_seq_len)"
        if figures.estimated:  # a server that counts nothing for us: from the characters
            total = "≈ " + total + " · estimated from characters"
        if over:
            total = f'<b style="color:{theme.colors()["danger"]}">{total} — does not fit</b>'
        self.context_label.setText(f"{text}<br>{total}")
