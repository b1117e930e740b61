"""DS-V4.1 Chat desktop app (PySide6).

The GUI thread never imports torch or the engine's model: it reads only the engine's torch-free modules
(the knob registry, errors, events, documents, memory reports). One worker thread (app.worker) owns the
model and the chat sessions; documents are parsed on a thread pool (app.documents). Everything the GUI
needs from the model arrives as plain data on signals.
"""
