"""Light and dark: the colours of the style sheet (resources/style.qss names them @name) and of the painted widgets
(the memory bar, the timeline), one table per theme. The theme follows the system's colour scheme, live;
DSV41_THEME=light or dark overrides it.

Contrast, WCAG's ratio (tests/app/test_theme.py checks it for both themes): every text colour against the
background it is drawn on at least 4.5:1 (dim and footer text included); the memory bar's segments against
the bar's track at least 2:1 (they also carry a legend and figures in text); "free" is faint on purpose (at least
1.2:1). Disabled controls are exempt, as WCAG says.
"""

from __future__ import annotations

import os
import re

LIGHT = {
    # surfaces
    "window": "#f4f6f8", "surface": "#ffffff", "toolbar": "#e9edf2", "border": "#d3d9e0", "input_border": "#c4ccd5",
    "user_bubble": "#e3edf8", "user_border": "#c9d9ea", "assistant_border": "#dde2e8", "selection": "#dbe7f4",
    # text
    "text": "#1c2733", "strong": "#33414f", "muted": "#4a5563", "dim": "#5c6672", "progress": "#5f6873",
    "link": "#56616e", "selection_text": "#1c2733",
    # accents and states
    "accent": "#3b6ea5", "accent_border": "#335f8f", "accent_hover": "#4479b3", "on_accent": "#ffffff",
    "disabled": "#a9b7c6", "disabled_text": "#eef2f6", "danger": "#a93226", "danger_disabled": "#b9bec5",
    "pending": "#8a5c00", "applied": "#2e7d32", "handle_border": "#8c98a6", "kv": "#f28e2b",
    "warn": "#fff4d6", "warn_border": "#f0d58a", "warn_text": "#6b5200",
    "attach": "#fdf1e2", "attach_border": "#f3d7b2", "attach_text": "#5b4a2e",
    "chip": "#fdf6ec", "chip_border": "#f0d3ad", "chip_bad": "#fdecea", "chip_bad_border": "#e6a39b",
    "chip_text": "#6b5a44",
    # painted widgets
    "bar_track": "#eef0f3", "bar_outline": "#b8bec6", "plot": "#fafbfc", "plot_grid": "#d5d9de", "plot_text": "#5f6670",
    "free": "#cdd3da",
    # the document text window's tint: what the cache holds hot (heat_3: in nearly every layer's heads)
    "heat_1": "#fce8d0", "heat_2": "#fbd9b3", "heat_3": "#f6b877",
}

DARK = {
    "window": "#1b1f24", "surface": "#23282e", "toolbar": "#262c33", "border": "#3a424b", "input_border": "#4a535d",
    "user_bubble": "#243447", "user_border": "#34495f", "assistant_border": "#363d45", "selection": "#2f4a66",
    "text": "#e4e8ec", "strong": "#d3dae1", "muted": "#b4bdc7", "dim": "#9aa4ae", "progress": "#a3acb6",
    "link": "#a9b4bf", "selection_text": "#f1f4f7",
    "accent": "#3b6ea5", "accent_border": "#4d82bb", "accent_hover": "#4479b3", "on_accent": "#ffffff",
    "disabled": "#3d4650", "disabled_text": "#8c96a0", "danger": "#f08a7e", "danger_disabled": "#6b5250",
    "pending": "#f2c14e", "applied": "#7ccf83", "handle_border": "#7d8894", "kv": "#f28e2b",
    "warn": "#3d3319", "warn_border": "#7a6424", "warn_text": "#f4dc97",
    "attach": "#3a2f22", "attach_border": "#6b5233", "attach_text": "#f0d9b8",
    "chip": "#33291d", "chip_border": "#6b5233", "chip_bad": "#402522", "chip_bad_border": "#8a4a42",
    "chip_text": "#e8d3b6",
    "bar_track": "#2d333a", "bar_outline": "#4a535d", "plot": "#20252b", "plot_grid": "#3a424b", "plot_text": "#a3acb6",
    "free": "#4f5963",
    "heat_1": "#3e3221", "heat_2": "#4d3a22", "heat_3": "#6e4a1c",
}

THEMES = {"light": LIGHT, "dark": DARK}
_current = "light"


def system_theme() -> str:
    """'dark' or 'light': DSV41_THEME when set, else the system's colour scheme (Qt 6.5+), else light."""
    forced = os.environ.get("DSV41_THEME", "").strip().lower()
    if forced in THEMES:
        return forced
    try:
        from PySide6.QtCore import Qt
        from PySide6.QtGui import QGuiApplication

        scheme = QGuiApplication.styleHints().colorScheme()
        return "dark" if scheme == Qt.ColorScheme.Dark else "light"
    except (AttributeError, RuntimeError):
        return "light"


def colors(theme: str | None = None) -> dict[str, str]:
    return THEMES[theme or _current]


def color(name: str):
    """A QColor of the current theme (the painted widgets ask at every paint, so a theme change shows at once)."""
    from PySide6.QtGui import QColor

    return QColor(colors()[name])


_scale = 100  # the text size (app/text_size.py), per cent: the style sheet's point sizes follow it
_template: str | None = None  # the style sheet's template last applied


def style_sheet(template: str, theme: str, scale: int | None = None) -> str:
    """The style sheet with each @name replaced by the theme's colour (an unknown name is an error) and each
    ``font-size: Npt`` scaled to the text size (`scale` per cent; default the one applied)."""
    table = THEMES[theme]
    factor = (scale if scale is not None else _scale) / 100

    def replace(match: re.Match) -> str:
        return table[match.group(1)]

    sheet = re.sub(r"@([a-z_]+)\b", replace, template)
    return re.sub(r"font-size:\s*(\d+(?:\.\d+)?)pt", lambda m: f"font-size: {float(m.group(1)) * factor:g}pt", sheet)


def text_scale() -> int:
    """The text size the style sheet's point sizes are at, per cent."""
    return _scale


def rescale(app, scale: int) -> None:
    """The style sheet's point sizes at `scale` per cent, and every widget it polished polished anew (a widget the
    sheet has polished keeps the font it had when the application's font changes)."""
    global _scale
    _scale = scale
    app.setStyleSheet(style_sheet(_template, _current) if _template is not None else app.styleSheet())


def apply(app, template: str, theme: str | None = None) -> str:
    """Use `theme` (default: the system's) for the Fusion palette and the style sheet; returns the theme."""
    global _current, _template
    from PySide6.QtGui import QColor, QPalette

    theme = theme or system_theme()
    _current, _template = theme, template
    c = THEMES[theme]
    palette = QPalette()
    roles = {QPalette.ColorRole.Window: c["window"], QPalette.ColorRole.WindowText: c["text"],
             QPalette.ColorRole.Base: c["surface"], QPalette.ColorRole.AlternateBase: c["toolbar"],
             QPalette.ColorRole.Text: c["text"], QPalette.ColorRole.Button: c["toolbar"],
             QPalette.ColorRole.ButtonText: c["text"], QPalette.ColorRole.ToolTipBase: c["surface"],
             QPalette.ColorRole.ToolTipText: c["text"], QPalette.ColorRole.Highlight: c["accent"],
             QPalette.ColorRole.HighlightedText: c["on_accent"], QPalette.ColorRole.PlaceholderText: c["dim"],
             QPalette.ColorRole.Link: c["accent_hover"], QPalette.ColorRole.BrightText: c["danger"]}
    for role, value in roles.items():
        palette.setColor(role, QColor(value))
    for role in (QPalette.ColorRole.Text, QPalette.ColorRole.ButtonText, QPalette.ColorRole.WindowText):
        palette.setColor(QPalette.ColorGroup.Disabled, role, QColor(c["dim"]))
    app.setPalette(palette)
    app.setStyleSheet(style_sheet(template, theme))
    for widget in app.allWidgets():
        changed = getattr(widget, "theme_changed", None)
        if callable(changed):  # widgets that baked a colour in (the chat's code blocks)
            changed()
        widget.update()
    return theme


def contrast(a: str, b: str) -> float:
    """WCAG 2 contrast ratio of two '#rrggbb' colours (1 to 21)."""
    def luminance(hex_color: str) -> float:
        channels = [int(hex_color[i:i + 2], 16) / 255 for i in (1, 3, 5)]
        linear = [ch / 12.92 if ch <= 0.03928 else ((ch + 0.055) / 1.055) ** 2.4 for ch in channels]
        return 0.2126 * linear[0] + 0.7152 * linear[1] + 0.0722 * linear[2]

    hi, lo = sorted((luminance(a), luminance(b)), reverse=True)
    return (hi + 0.05) / (lo + 0.05)
