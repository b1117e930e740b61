"""The main window's parts; each owns its widgets and talks to the window by signals."""


def fit_to_text(button, padding: int = 16) -> None:
    """Let a push button shrink to its text (the style's own minimum is 80 px whatever the text): the window then
    lays out at 1024 px wide."""
    extra = 18 if button.menu() is not None else 0  # the menu arrow
    button.setMinimumWidth(button.fontMetrics().horizontalAdvance(button.text()) + padding + extra)
