"""The app's text size (View ▸ Larger text / Smaller text / Actual text size; Ctrl++ or Ctrl+=, Ctrl+-, Ctrl+0): every widget's
font, the chat's text included, scaled from the font the app started with, in steps of a browser's zoom. Kept in
the settings across starts."""

from __future__ import annotations

from PySide6.QtGui import QFont
from PySide6.QtWidgets import QApplication

SCALES = (80, 90, 100, 110, 125, 150, 175, 200)  # per cent of the system's font
ACTUAL = 100
_BASE = "dsv41_base_font"  # the QApplication property holding the font the app started with


def sanitize(value) -> int:
    """A saved scale: one of SCALES (a damaged or hand-edited value gives the actual size)."""
    try:
        scale = int(value)
    except (TypeError, ValueError):
        return ACTUAL
    return scale if scale in SCALES and str(value).strip() == str(scale) else ACTUAL


def base_font(app: QApplication) -> QFont:
    """The font the app had before any scaling (recorded on the application the first time it is asked)."""
    stored = app.property(_BASE)
    if isinstance(stored, QFont):
        return QFont(stored)
    base = QFont(app.font())
    app.setProperty(_BASE, base)
    return QFont(base)


def apply(app: QApplication, scale: int) -> QFont:
    """Set the application's font, and the style sheet's point sizes, to `scale` per cent of the system's; the font
    set. Nothing changes where they already are."""
    from . import theme

    font = base_font(app)
    if font.pointSizeF() > 0:
        font.setPointSizeF(font.pointSizeF() * scale / 100)
    elif font.pixelSize() > 0:
        font.setPixelSize(max(1, round(font.pixelSize() * scale / 100)))
    if font != app.font() or theme.text_scale() != scale:
        app.setFont(font)
        theme.rescale(app, scale)
    return font


def step(scale: int, direction: int) -> int:
    """The next scale up (+1) or down (-1) from `scale`; the ends stay where they are."""
    index = SCALES.index(sanitize(scale)) + direction
    return SCALES[min(max(index, 0), len(SCALES) - 1)]
