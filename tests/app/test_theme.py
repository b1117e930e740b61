"""Light and dark themes (app/theme.py): complete, readable (WCAG contrast), applied to the palette, the style sheet
and the painted memory widgets, and switchable while the app runs."""

from __future__ import annotations

import re

import pytest

from app import theme
from app.main import style_sheet

# (text colour, the background it is drawn on) for every text the style sheet and the painted widgets draw
TEXT_PAIRS = [("text", "window"), ("text", "surface"), ("strong", "surface"), ("strong", "window"),
              ("muted", "toolbar"), ("muted", "surface"), ("dim", "surface"), ("dim", "window"),
              ("dim", "user_bubble"), ("progress", "surface"), ("link", "surface"), ("link", "user_bubble"),
              ("on_accent", "accent"), ("danger", "surface"), ("pending", "surface"), ("applied", "surface"),
              ("warn_text", "warn"), ("attach_text", "attach"), ("chip_text", "chip"), ("chip_text", "chip_bad"),
              ("plot_text", "plot"), ("selection_text", "selection"), ("text", "user_bubble"),
              ("text", "heat_1"), ("text", "heat_2"), ("text", "heat_3")]
MEMORY = {"Weights": "#4e79a7", "KV cache": "#f28e2b", "Activations": "#59a14f", "Other": "#9d8f8a"}


@pytest.mark.parametrize("name", ["light", "dark"])
def test_each_theme_names_every_colour_of_the_style_sheet(name):
    template = style_sheet()
    used = set(re.findall(r"@([a-z_]+)", template))
    assert used and used <= set(theme.THEMES[name])
    assert set(theme.LIGHT) == set(theme.DARK)
    assert "@" not in theme.style_sheet(template, name)


@pytest.mark.parametrize("name", ["light", "dark"])
def test_text_is_readable_and_the_memory_colours_stand_out_in_both_themes(name):
    c = theme.THEMES[name]
    low = {(a, b): round(theme.contrast(c[a], c[b]), 2) for a, b in TEXT_PAIRS if theme.contrast(c[a], c[b]) < 4.5}
    assert not low, f"text below 4.5:1 in the {name} theme: {low}"
    from app.widgets.memory_panel import MEMORY_COLORS

    for segment, colour in MEMORY_COLORS.items():
        if segment != "Free":
            assert MEMORY[segment] == colour
            assert theme.contrast(colour, c["bar_track"]) >= 2.0, (segment, name)
    assert theme.contrast(c["free"], c["bar_track"]) >= 1.2


def test_dark_and_light_reach_the_palette_the_style_sheet_and_the_painted_widgets(qtbot, monkeypatch):
    from PySide6.QtGui import QColor, QPalette
    from PySide6.QtWidgets import QApplication

    from app.main import make_application
    from app.widgets.memory_panel import Timeline

    monkeypatch.setenv("DSV41_THEME", "dark")
    app = make_application([])
    assert theme.system_theme() == "dark"
    try:
        assert app.palette().color(QPalette.ColorRole.Window) == QColor(theme.DARK["window"])
        assert theme.DARK["surface"] in app.styleSheet() and theme.LIGHT["window"] not in app.styleSheet()
        plot = Timeline()
        qtbot.addWidget(plot)
        plot.resize(200, 60)
        assert plot.grab().toImage().pixelColor(100, 58) == QColor(theme.DARK["plot"])
        from app.widgets.chat_view import MessageBubble

        bubble = MessageBubble("assistant", "Code:\n\n```python\nprint(1)\n```\n")
        qtbot.addWidget(bubble)

        from PySide6.QtCore import Qt

        def code_shade():
            block = bubble.view.document().begin()
            while block.isValid():
                brush = block.blockFormat().background()
                if brush.style() != Qt.BrushStyle.NoBrush:
                    return brush.color()
                block = block.next()
            return None

        assert code_shade() == QColor(theme.DARK["toolbar"])
        theme.apply(app, style_sheet(), "light")  # a switch while running (the system's scheme changed)
        assert code_shade() == QColor(theme.LIGHT["toolbar"])  # the code block follows (it was baked in)
        assert app.palette().color(QPalette.ColorRole.Window) == QColor(theme.LIGHT["window"])
        assert plot.grab().toImage().pixelColor(100, 58) == QColor(theme.LIGHT["plot"])
    finally:
        monkeypatch.delenv("DSV41_THEME")
        theme.apply(QApplication.instance(), style_sheet(), "light")


def test_latin_text_is_drawn_in_the_system_font_and_chinese_in_a_cjk_fallback(qapp):
    # fontconfig's "Sans Serif" is an alias: first in the families list it matched nothing, so Latin text too was
    # drawn in the CJK fallback, whose apostrophes and quotes are full width ("file’ s")
    from PySide6.QtGui import QFont, QFontDatabase, QFontInfo, QTextLayout

    from app.main import CJK_FALLBACKS, ui_font

    def families(text: str, font: QFont) -> list[str]:
        layout = QTextLayout(text, font)
        layout.beginLayout()
        layout.createLine()
        layout.endLayout()
        return [run.rawFont().familyName() for run in layout.glyphRuns()]

    for system in (QFont("Sans Serif"), QFont(qapp.font().family())):
        font = ui_font(system)
        resolved = QFontInfo(system).family()
        assert font.families()[0] == resolved and QFontInfo(font).family() == resolved
        assert families("the file’s “quoted” name", font) == [resolved]
        installed = [f for f in CJK_FALLBACKS if f in QFontDatabase.families()]
        if installed and not QFontInfo(QFont(resolved)).family().startswith(tuple(installed)):
            assert set(families("港口的吞吐量", font)) <= set(installed)
