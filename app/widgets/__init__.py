"""The main window's parts; each owns its widgets and talks to the window by signals."""
