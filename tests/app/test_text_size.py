"""The app's text size (View ▸ Larger text / Smaller text / Actual text size): every widget's font scales from the
system's, the chat's bubbles reflow to it, and the size is back after a restart."""

from __future__ import annotations

import pytest
from conftest import send
from PySide6.QtCore import QEvent
from PySide6.QtGui import QFontMetrics, QKeySequence
from PySide6.QtWidgets import QApplication, QLabel, QPushButton

from app import text_size, theme
from app.main import style_sheet
from app.settings import Key, Settings
from app.widgets.chat_view import MarkdownView


@pytest.fixture(autouse=True)
def styled_app(qapp, monkeypatch):
    """The application as the app makes it, with its palette and style sheet (a widget the sheet has polished keeps
    its font when the application's changes), back as it was after the test."""
    # the previous test's window, closed, waits for its deletion (pytest-qt's deleteLater): deleted first, so that
    # re-polishing every widget (the style sheet set again) never reaches one half torn down (it crashed Qt)
    qapp.sendPostedEvents(None, QEvent.Type.DeferredDelete)
    palette, sheet = qapp.palette(), qapp.styleSheet()
    monkeypatch.setattr(theme, "_template", None)
    monkeypatch.setattr(theme, "_current", theme._current)
    theme.apply(qapp, style_sheet())
    yield
    text_size.apply(qapp, text_size.ACTUAL)  # the next test starts with the system's font
    qapp.setStyleSheet(sheet)
    qapp.setPalette(palette)


def point_size(widget=None) -> float:
    return (widget.font() if widget is not None else QApplication.font()).pointSizeF()


def test_larger_smaller_and_actual_size_scale_every_widget_and_reflow_the_chat(qtbot, window):
    base = text_size.base_font(QApplication.instance()).pointSizeF()
    assert base > 0 and point_size() == pytest.approx(base)
    send(qtbot, window, "A question long enough to wrap over more than one line of the chat's bubble when the "
                        "text is large, so that its height follows the text size.")
    markdown_views = window.chat.findChildren(MarkdownView)
    assert markdown_views
    first = markdown_views[0]
    height = first.height()
    labels = window.findChildren(QLabel) + window.findChildren(QPushButton)
    before = [point_size(w) for w in labels]
    assert {8.5, 11.0} < {round(size / base * 9, 3) for size in before} or base != 9  # the sheet's own sizes

    larger, smaller, actual = (window.actions_by_name[n] for n in ("larger_text", "smaller_text", "actual_text"))
    larger.trigger()
    assert window.text_size == 110 and point_size() == pytest.approx(base * 1.1)
    qtbot.waitUntil(lambda: point_size(window.composer) == pytest.approx(base * 1.1), timeout=2000)
    # the panels' labels and buttons too, those whose size the style sheet sets (footers, hints) as well
    assert [point_size(w) for w in labels] == pytest.approx([size * 1.1 for size in before])
    assert first.document().defaultFont().pointSizeF() == pytest.approx(base * 1.1)
    larger.trigger()
    larger.trigger()
    assert window.text_size == 150
    qtbot.waitUntil(lambda: first.height() > height, timeout=2000)  # the bubble grew with its text
    # the reply's code (the Markdown reader sets the system's fixed font at its own size) follows the text too
    reply = markdown_views[-1]
    assert "print('hello')" in reply.toPlainText()
    assert code_sizes(reply) == {round(base * 1.5, 3)}
    # the parts sized to their font at start fit the new one: buttons' text, the two-line compression line, the
    # memory timeline's axis labels, the side panel's width
    for button in (window.regenerate_button, window.attach_button):
        assert button.minimumWidth() >= button.fontMetrics().horizontalAdvance(button.text())
    ratio = window.memory_panel.ratio_label
    assert ratio.height() >= 2 * ratio.fontMetrics().lineSpacing()
    timeline = window.memory_panel.timeline
    assert timeline.minimumHeight() >= 44 + QFontMetrics(timeline._label_font()).height()
    assert window.side_panel.minimumWidth() == round(330 * 1.5)
    assert Settings().value(Key.TEXT_SIZE) in (150, "150")

    smaller.trigger()
    assert window.text_size == 125 and point_size() == pytest.approx(base * 1.25)
    actual.trigger()
    assert window.text_size == 100 and point_size() == pytest.approx(base)
    qtbot.waitUntil(lambda: first.height() == height, timeout=2000)


def code_sizes(view) -> set[float]:
    """The point sizes of a Markdown view's text in the fixed font."""
    sizes, block = set(), view.document().begin()
    while block.isValid():
        fragments = block.begin()
        while not fragments.atEnd():
            fmt = fragments.fragment().charFormat()
            if fmt.fontFixedPitch() or "monospace" in (fmt.fontFamilies() or []):
                sizes.add(round(fmt.font().pointSizeF(), 3))
            fragments += 1
        block = block.next()
    return sizes


def test_the_ends_stop_and_their_action_is_disabled(window):
    larger, smaller = window.actions_by_name["larger_text"], window.actions_by_name["smaller_text"]
    for _ in range(20):
        larger.trigger()
    assert window.text_size == text_size.SCALES[-1] == 200 and not larger.isEnabled() and smaller.isEnabled()
    for _ in range(20):
        smaller.trigger()
    assert window.text_size == text_size.SCALES[0] == 80 and not smaller.isEnabled() and larger.isEnabled()


def test_the_shortcuts_are_a_browsers(window):
    keys = {name: [s.toString() for s in window.actions_by_name[name].shortcuts()]
            for name in ("larger_text", "smaller_text", "actual_text")}
    assert QKeySequence(QKeySequence.StandardKey.ZoomIn).toString() in keys["larger_text"]
    assert "Ctrl+=" in keys["larger_text"] and "Ctrl+0" in keys["actual_text"]
    assert QKeySequence(QKeySequence.StandardKey.ZoomOut).toString() in keys["smaller_text"]
    assert any("Larger text" in line for line in window.shortcut_lines())


def test_the_text_size_is_back_after_a_restart(make_window):
    first = make_window()
    first.actions_by_name["larger_text"].trigger()
    first.actions_by_name["larger_text"].trigger()
    first.close()
    text_size.apply(QApplication.instance(), text_size.ACTUAL)
    again = make_window()
    base = text_size.base_font(QApplication.instance()).pointSizeF()
    assert again.text_size == 125 and point_size() == pytest.approx(base * 1.25)


@pytest.mark.parametrize("saved", ["huge", "130", "1e9", "-100", "", "125.0"])
def test_a_damaged_saved_size_starts_at_the_actual_size(make_window, saved):
    Settings().set(Key.TEXT_SIZE, saved)
    window = make_window()
    assert window.text_size == 100
    assert point_size() == pytest.approx(text_size.base_font(QApplication.instance()).pointSizeF())


def test_step_and_sanitize():
    assert text_size.step(100, 1) == 110 and text_size.step(100, -1) == 90
    assert text_size.step(200, 1) == 200 and text_size.step(80, -1) == 80
    assert text_size.step("junk", 1) == 110  # from the actual size
    assert [text_size.sanitize(v) for v in (150, "150", "151", None, True, 2.5)] == [150, 150, 100, 100, 100, 100]


def test_ctrl_and_the_mouse_wheel_over_the_chat_change_the_text_size(qtbot, window):
    from PySide6.QtCore import QPoint, QPointF, Qt
    from PySide6.QtGui import QWheelEvent

    def wheel(dy: int, modifiers) -> None:
        viewport = window.chat.viewport()
        event = QWheelEvent(QPointF(10, 10), QPointF(viewport.mapToGlobal(QPoint(10, 10))), QPoint(0, 0),
                            QPoint(0, dy), Qt.MouseButton.NoButton, modifiers, Qt.ScrollPhase.NoScrollPhase, False)
        QApplication.sendEvent(viewport, event)

    wheel(120, Qt.KeyboardModifier.ControlModifier)
    assert window.text_size == 110
    wheel(-120, Qt.KeyboardModifier.ControlModifier)
    wheel(-120, Qt.KeyboardModifier.ControlModifier)
    assert window.text_size == 90
    wheel(-120, Qt.KeyboardModifier.NoModifier)  # the wheel alone scrolls
    assert window.text_size == 90
