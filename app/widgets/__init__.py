"""The main window's parts; each owns its widgets and talks to the window by signals."""

from PySide6.QtCore import QEvent, QObject


class _Refit(QObject):
    """Fits a button to its text again when its font changes (the app's text size, or the style sheet's font)."""

    def __init__(self, button, padding: int):
        super().__init__(button)
        self.padding = padding

    def eventFilter(self, watched, event) -> bool:  # noqa: N802 - Qt override
        if event.type() == QEvent.Type.FontChange:
            _fit(watched, self.padding)
        return False


def _fit(button, padding: int) -> None:
    extra = 18 if button.menu() is not None else 0  # the menu arrow
    button.setMinimumWidth(button.fontMetrics().horizontalAdvance(button.text()) + padding + extra)


def fit_to_text(button, padding: int = 16) -> None:
    """Let a push button shrink to its text (the style's own minimum is 80 px whatever the text): the window then
    lays out at 1024 px wide. It fits again whenever its font changes."""
    _fit(button, padding)
    if not any(isinstance(child, _Refit) for child in button.children()):
        button.installEventFilter(_Refit(button, padding))
