"""The main window: conversations | chat + documents + composer | memory + knobs, model bar on top.

It wires the parts together; turns live in app.turns, the engine in app.worker (its own thread),
document parsing in app.documents (a thread pool), storage in app.store.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import sqlite3
import time
from collections import OrderedDict
from pathlib import Path

from PySide6.QtCore import Qt, QTimer, Signal
from PySide6.QtGui import QAction, QKeySequence
from PySide6.QtWidgets import (
    QApplication,
    QFileDialog,
    QHBoxLayout,
    QLabel,
    QMainWindow,
    QMessageBox,
    QPushButton,
    QScrollArea,
    QSplitter,
    QVBoxLayout,
    QWidget,
)

from . import knobs as K
from . import text_size
from .chat_import import ChatImportError, parse_export, read_export
from .documents import MIN_SUGGESTED_RATIO, DocumentLoader, assess_fit
from .protocol import (
    AttachedDocument,
    ContextFigures,
    DocumentFigures,
    GenerationOptions,
    HeatRequest,
    PinRequest,
    UsageRequest,
)
from .settings import Key, Settings
from .store import ConversationStore, StoreUnavailable, reply_footer
from .turns import TurnController
from .widgets import fit_to_text
from .widgets.chat_view import ChatView, MessageBubble
from .widgets.composer import Composer
from .widgets.conversation_list import ConversationList
from .widgets.document_chips import DocumentChips
from .widgets.document_text import DocumentTextDialog
from .widgets.download_dialog import DownloadDialog
from .widgets.knob_panel import KnobPanel
from .widgets.memory_panel import MemoryPanel
from .widgets.model_panel import ModelPanel
from .widgets.system_prompt import SystemPromptBox
from .worker import EngineClient

log = logging.getLogger(__name__)

MEMORY_REFRESH_MS = 1000
USAGE_DEBOUNCE_MS = 400
NEW_CHAT_TITLE = "New chat"
SIDE_MIN_WIDTH = 330  # the memory and knob panel at the actual text size (it widens with a larger one)
WITHDRAWN_NOTICE = ("Stopped before the reply began: the message (and its documents) are back in the message box, "
                    "nothing of it was kept.")
# The Attach dialog's filters, every file first (the one it opens with): a download saved without a suffix, or under
# one the app does not know, is read by its content (engine.documents), so hiding it would leave it unpickable
ATTACH_FILTERS_DEFAULT = "All files (*)"
ATTACH_FILTERS = (f"{ATTACH_FILTERS_DEFAULT};;"
                  "Documents (*.txt *.md *.markdown *.pdf *.docx *.docm *.py *.js *.ts *.c *.cpp *.h *.java *.go *.rs "
                  "*.json *.yaml *.yml *.toml *.html *.css *.sql *.sh *.csv)")
LOAD_HELP = {
    "missing": "Check the path, or pick 'default'.",
    "offline": "Download the model folder on a machine that is online and pick the folder here, or use 'default'.",
    "corrupt": "Download the model again.",
    "unsupported": "Pick a model folder (config.json + .safetensors) or a .gguf file.",
    "unsupported_architecture": "Pick a Llama, Mistral, Qwen2 or Qwen3 model.",
    "unsupported_type": "Pick a .gguf file of the same model in a common quantization (Q4_K_M, Q8_0, ...).",
    "remote_code": "Only models that run without their own Python code are supported.",
    "oom": "Pick INT8 or INT4 weights, a smaller model, or the CPU.",
    "config": "Fix the value named in the message.",
    "remote": "Check the address: it should be the server's API root, such as http://127.0.0.1:8000/v1.",
    "remote_auth": "Set the server's API key (Open ▸ OpenAI-compatible server…) and connect again.",
    "remote_unreachable": "Start the server (python -m engine serve, vLLM, SGLang, LM Studio…) or fix the "
                          "address, then connect again.",
    "no_gpu": "Set Device to Auto or CPU.",
    "disk": "Free some space on the disk named in the message, then load again.",
    "missing_library": "Install the library named in the message, or pick other weights (Full precision needs none).",
    "pickled": "Pick a .safetensors or .gguf copy of the model (a pickled checkpoint can run code when it is read).",
    "load_failed": "Check the message: try Full precision weights, Device Auto, or the default model.",
}


class MainWindow(QMainWindow):
    message_shown = Signal(str, str)  # title, text — every dialog also goes here (tests, status bar)

    def __init__(self, model_factory=None, *, autoload: bool = True, store: ConversationStore | None = None,
                 settings: Settings | None = None):
        super().__init__()
        self.setWindowTitle("DS-V4.1 Chat")
        self.setObjectName("mainWindow")
        self.setAcceptDrops(True)
        self.settings = settings or Settings()
        self.store = store or ConversationStore()
        self.client = EngineClient(model_factory, self)
        self.loader = DocumentLoader(self)
        self.facts = None  # ModelFacts of the loaded model
        self.report = None  # latest MemoryReport
        self.figures: ContextFigures | None = None
        self.conversation_id: int | None = None
        self.attached: OrderedDict[str, AttachedDocument | None] = OrderedDict()  # None while parsing
        self.doc_tokens: dict[str, int] = {}  # the engine's count per attachment key
        self.doc_figures: dict[str, DocumentFigures] = {}  # the engine's latest figures per attachment key
        self.editing_message_id: int | None = None
        # what was in the box when an edit began (text, documents): back in the box when the edit ends
        self._draft: tuple[str, dict] | None = None
        # the message box of each saved chat not shown (text, documents), set aside when another chat was opened
        self._drafts: dict[int | None, tuple[str, dict]] = {}
        self._doc_paths: dict[str, str] = {}  # the file each attachment still being read comes from
        # the user opened a new, empty chat (New chat): reloading the list must not open another one instead
        self._new_chat = False
        self._showing = False  # a chat's own settings are being put back (not a change to save)
        self.loading = False
        self._after_load = None  # a callable to run once the next load succeeds (OOM retry)
        self._loading_options: dict | None = None  # the model panel's choice being loaded
        self._memory_requested = False
        self.open_dialogs: list[QMessageBox] = []
        self.text_windows: list = []  # documents' text shown (DocumentTextDialog), open beside the chat
        self._heat_asked: dict[int, object] = {}  # HeatRequest.request_id -> the text window that asked
        self._pin_asked: dict[int, tuple[int, list[str]]] = {}  # PinRequest.request_id -> (chat, its pins)
        self._pins_asked: dict[int, list[str]] = {}  # each chat's pins last asked for, until the engine answers
        self._request_ids = itertools.count(1)
        self._attach_failures: QMessageBox | None = None  # the open message about files that could not be read
        self._attach_failed = 0  # how many it names
        self.closed = False
        self.shown_messages: list[tuple[str, str]] = []
        self.text_size = text_size.ACTUAL  # per cent of the system font (View menu)

        self._build()
        self.turns = TurnController(self.store, self.client, self.chat, self)
        self._connect()
        self._restore_settings()
        self._reload_conversations(select=self.settings.last_conversation())
        self._restore_draft()
        self._update_actions()
        if self.store.recovered:
            self.statusBar().showMessage(f"{self.store.recovered} reply(ies) were interrupted last time; "
                                         "what was shown is kept.", 8000)
        if self.store.read_only:  # a read-only or full data folder: say which, and what to do
            QTimer.singleShot(0, lambda: self.inform("Chats cannot be saved", self.store.problem))
        elif self.store.notice:  # a damaged chats file was set aside and what it held copied back
            QTimer.singleShot(0, lambda: self.inform("The chats file was damaged", self.store.notice))
        if autoload:
            QTimer.singleShot(0, self.model_panel.request_load)

    # ------------------------------------------------------------------ layout
    def _build(self) -> None:
        self.model_panel = ModelPanel()
        self.conversations = ConversationList()
        self.chat = ChatView()
        self.chips = DocumentChips()
        self.composer = Composer()
        self.edit_banner = QLabel("")
        self.edit_banner.setObjectName("editBanner")
        self.edit_banner.hide()
        self.attach_button = QPushButton("⊕ Attach…")
        self.send_button = QPushButton("Send")
        self.send_button.setObjectName("sendButton")
        self.stop_button = QPushButton("■ Stop")
        self.stop_button.setObjectName("stopButton")
        self.regenerate_button = QPushButton("↻ Regenerate")
        self.edit_button = QPushButton("✎ Edit last")
        self.memory_panel = MemoryPanel()
        self.knob_panel = KnobPanel()
        self.system_prompt = SystemPromptBox()

        center = QWidget()
        center_layout = QVBoxLayout(center)
        center_layout.setContentsMargins(0, 0, 0, 6)
        center_layout.setSpacing(4)
        center_layout.addWidget(self.system_prompt)
        center_layout.addWidget(self.chat, 1)
        bottom = QVBoxLayout()
        bottom.setContentsMargins(8, 0, 8, 0)
        bottom.setSpacing(4)
        bottom.addWidget(self.edit_banner)
        bottom.addWidget(self.chips)
        bottom.addWidget(self.composer)
        buttons = QHBoxLayout()
        for button in (self.attach_button, self.edit_button, self.regenerate_button):
            fit_to_text(button)
        for button in (self.stop_button, self.send_button):  # bold, with the style sheet's wider padding
            fit_to_text(button, padding=32)
        for button in (self.attach_button, self.edit_button, self.regenerate_button):
            buttons.addWidget(button)
        buttons.addStretch(1)
        buttons.addWidget(self.stop_button)
        buttons.addWidget(self.send_button)
        bottom.addLayout(buttons)
        center_layout.addLayout(bottom)

        side = QWidget()
        side_layout = QVBoxLayout(side)
        side_layout.setContentsMargins(4, 4, 4, 4)
        side_layout.addWidget(self.memory_panel)
        side_layout.addWidget(self.knob_panel)
        side_layout.addStretch(1)
        side_scroll = QScrollArea()
        side_scroll.setObjectName("sidePanel")
        side_scroll.setWidgetResizable(True)
        side_scroll.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        side_scroll.setWidget(side)
        side_scroll.setMinimumWidth(SIDE_MIN_WIDTH)
        self.side_panel = side_scroll

        self.splitter = QSplitter(Qt.Orientation.Horizontal)
        self.splitter.addWidget(self.conversations)
        self.splitter.addWidget(center)
        self.splitter.addWidget(side_scroll)
        self.splitter.setStretchFactor(1, 1)
        self.splitter.setSizes([220, 660, 380])
        root = QWidget()
        root_layout = QVBoxLayout(root)
        root_layout.setContentsMargins(0, 0, 0, 0)
        root_layout.setSpacing(0)
        root_layout.addWidget(self.model_panel)
        root_layout.addWidget(self.splitter, 1)
        self.setCentralWidget(root)
        self.resize(1280, 800)

        self._build_menus()

    def _build_menus(self) -> None:
        """The window's shortcuts, each an action of the Chat menu, and Help → Keyboard shortcuts listing them."""
        chat_menu = self.menuBar().addMenu("&Chat")
        self.actions_by_name: dict[str, QAction] = {}
        for name, label, keys, slot in (
                ("new", "New chat", QKeySequence(QKeySequence.StandardKey.New), self.new_conversation),
                ("search", "Search chats", QKeySequence(QKeySequence.StandardKey.Find), self.focus_search),
                ("stop", "Stop the reply", QKeySequence(Qt.Key.Key_Escape), self.escape),
                ("regenerate", "Regenerate the last reply", QKeySequence("Ctrl+R"), self.regenerate),
                ("edit_last", "Edit the last message", QKeySequence("Ctrl+E"), self.edit_last),
                ("attach", "Attach documents…", QKeySequence("Ctrl+O"), self._pick_files),
                ("attach_folder", "Attach a folder…", QKeySequence("Ctrl+Shift+O"), self._pick_folder),
                ("document_memory", "What the cache holds of the documents", QKeySequence("Ctrl+Shift+H"),
                 self.show_document_memory),
                ("import", "Import a chat…", QKeySequence(), self._pick_chat_to_import)):
            action = QAction(label, self, shortcut=keys)
            action.setShortcutContext(Qt.ShortcutContext.WindowShortcut)
            action.triggered.connect(slot)
            chat_menu.addAction(action)
            self.actions_by_name[name] = action
        view_menu = self.menuBar().addMenu("&View")
        for name, label, keys, widget in (
                ("show_chats", "Chats list", "Ctrl+Shift+L", self.conversations),
                ("show_side", "Memory and knobs", "Ctrl+Shift+M", self.side_panel)):
            action = QAction(label, self, shortcut=QKeySequence(keys), checkable=True, checked=True)
            action.toggled.connect(widget.setVisible)
            view_menu.addAction(action)
            self.actions_by_name[name] = action
        view_menu.addSeparator()
        for name, label, keys, direction in (
                ("larger_text", "Larger text", (QKeySequence.StandardKey.ZoomIn, "Ctrl+="), 1),
                ("smaller_text", "Smaller text", (QKeySequence.StandardKey.ZoomOut,), -1),
                ("actual_text", "Actual text size", ("Ctrl+0",), 0)):
            action = QAction(label, self)
            action.setShortcuts([QKeySequence(key) for key in keys])
            action.setShortcutContext(Qt.ShortcutContext.WindowShortcut)
            action.triggered.connect(lambda _checked=False, d=direction: self.set_text_size(
                text_size.step(self.text_size, d) if d else text_size.ACTUAL))
            view_menu.addAction(action)
            self.actions_by_name[name] = action
        help_menu = self.menuBar().addMenu("&Help")
        shortcuts = QAction("Keyboard shortcuts", self, shortcut=QKeySequence(QKeySequence.StandardKey.HelpContents))
        shortcuts.triggered.connect(self.show_shortcuts)
        help_menu.addAction(shortcuts)
        self.actions_by_name["shortcuts"] = shortcuts

    def set_text_size(self, scale: int) -> None:
        """Every widget's text at `scale` per cent of the system font (View menu), kept for the next start."""
        self.text_size = text_size.sanitize(scale)
        text_size.apply(QApplication.instance(), self.text_size)
        # the side panel's rows (the memory figures, the knobs' labels) widen with their text
        self.side_panel.setMinimumWidth(round(SIDE_MIN_WIDTH * max(self.text_size, 100) / 100))
        self.actions_by_name["larger_text"].setEnabled(self.text_size < text_size.SCALES[-1])
        self.actions_by_name["smaller_text"].setEnabled(self.text_size > text_size.SCALES[0])
        self.settings.set(Key.TEXT_SIZE, self.text_size)

    def shortcut_lines(self) -> list[str]:
        """'Ctrl+N — New chat', one per shortcut, plus the composer's own keys."""
        lines = [f"{a.shortcut().toString(QKeySequence.SequenceFormat.NativeText)} — {a.text()}"
                 for a in self.actions_by_name.values() if not a.shortcut().isEmpty()]
        return lines + ["Enter — Send", "Shift+Enter — New line in the message",
                        "Up (in an empty message box) — Edit the last message",
                        "Esc — Stop the reply (or its reading); while editing, cancel the edit"]

    def show_shortcuts(self) -> None:
        self.inform("Keyboard shortcuts", "\n".join(self.shortcut_lines()), icon=QMessageBox.Icon.Information)

    def focus_search(self) -> None:
        self.conversations.search.setFocus()
        self.conversations.search.selectAll()

    def escape(self) -> None:
        """Esc: stop the reply (also while its prompt is still being read); otherwise leave an edit."""
        if self.turns.busy:
            self.stop()
        else:
            self.cancel_edit()

    def _connect(self) -> None:
        worker = self.client.worker
        worker.load_progress.connect(self.model_panel.show_loading)
        worker.loaded.connect(self._on_loaded)
        worker.load_failed.connect(self._on_load_failed)
        worker.memory.connect(self._on_memory)
        worker.heat.connect(self._on_heat)
        worker.pinned.connect(self._on_pinned)
        worker.usage.connect(self._on_usage)
        worker.reconfigured.connect(self._on_reconfigured)
        worker.reconfigure_failed.connect(self._on_reconfigure_failed)
        worker.document_figures.connect(self._on_document_figures)
        worker.prefill_progress.connect(self._on_rebuild_progress)
        worker.error.connect(lambda message: self.inform("Engine error", message))
        self.turns.started.connect(self._update_actions)
        self.turns.finished.connect(self._on_turn_finished)
        self.turns.save_failed.connect(lambda message: self._save_failed(
            f"The reply could not be saved ({message}); it stays on screen."))
        self.turns.refused.connect(self._on_turn_refused)
        self.turns.withdrawn.connect(self._on_turn_withdrawn)

        self.model_panel.load_requested.connect(self.load_model)
        self.model_panel.download_requested.connect(self.open_download)
        self.model_panel.serve_requested.connect(self.client.start_serving.emit)
        self.model_panel.serve_stop_requested.connect(self.client.stop_serving.emit)
        worker.serving.connect(self._on_serving)
        self.conversations.selected.connect(self.show_conversation)
        self.conversations.new_requested.connect(self.new_conversation)
        self.conversations.delete_requested.connect(self.delete_conversation)
        self.conversations.renamed.connect(self._on_renamed)
        self.conversations.export_requested.connect(self.export_conversation)
        self.conversations.duplicate_requested.connect(self.duplicate_conversation)
        self.conversations.search_changed.connect(self._on_search)

        self.composer.submitted.connect(self.send)
        self.composer.files_dropped.connect(self.attach_files)
        self.composer.escape_pressed.connect(self.escape)
        self.composer.edit_last_requested.connect(self.edit_last)
        self.chat.message_action.connect(self._on_message_action)
        self.composer.textChanged.connect(self._schedule_usage)
        self.send_button.clicked.connect(self.send)
        self.stop_button.clicked.connect(self.stop)
        self.regenerate_button.clicked.connect(self.regenerate)
        self.edit_button.clicked.connect(self.edit_last)
        self.attach_button.clicked.connect(self._pick_files)
        self.chips.remove_requested.connect(self.remove_document)
        self.chips.text_requested.connect(lambda key: self.show_document_text(self.attached.get(key)))
        self.chat.document_requested.connect(self._show_sent_document)
        self.chat.zoom_requested.connect(lambda d: self.set_text_size(text_size.step(self.text_size, d)))
        self.loader.parsed.connect(self._on_document_parsed)
        self.loader.failed.connect(self._on_document_failed)
        self.loader.listed.connect(self._on_folder_listed)
        self.knob_panel.knobs_changed.connect(self._on_knobs_changed)
        self.knob_panel.generation_changed.connect(self._on_generation_changed)
        self.system_prompt.changed.connect(self._on_system_prompt_changed)
        self.system_prompt.make_default.connect(self._make_default_system_prompt)

        self.memory_timer = QTimer(self, interval=MEMORY_REFRESH_MS)
        self.memory_timer.timeout.connect(self._request_memory)
        self.memory_timer.start()
        self.usage_timer = QTimer(self, singleShot=True, interval=USAGE_DEBOUNCE_MS)
        self.usage_timer.timeout.connect(self._request_usage)

    # ------------------------------------------------------------------ messages
    def inform(self, title: str, text: str, *, icon=QMessageBox.Icon.Warning, buttons=None) -> QMessageBox:
        """A window-modal message that does not block the event loop (the worker keeps streaming)."""
        log.info("%s: %s", title, text)
        self.shown_messages.append((title, text))
        self.message_shown.emit(title, text)
        self.statusBar().showMessage(f"{title}: {text}", 10000)
        box = QMessageBox(icon, title, text, QMessageBox.StandardButton.NoButton, self)
        box.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        for label, role, callback in buttons or [("OK", QMessageBox.ButtonRole.AcceptRole, None)]:
            button = box.addButton(label, role)
            if callback is not None:
                button.clicked.connect(callback)
        box.finished.connect(lambda _r, b=box: self.open_dialogs.remove(b) if b in self.open_dialogs else None)
        box.setAttribute(Qt.WidgetAttribute.WA_DeleteOnClose)
        self.open_dialogs.append(box)
        box.open()
        return box

    def confirm(self, title: str, text: str) -> bool:
        """A yes/no question (tests replace this)."""
        answer = QMessageBox.question(self, title, text)
        return answer == QMessageBox.StandardButton.Yes

    # ------------------------------------------------------------------ model
    def load_model(self, options: dict) -> None:
        if self.turns.busy:
            self.inform("Model change refused", "A reply is being generated. Stop it (■ Stop) or wait for it to "
                        "finish, then load the other model.")
            return
        self.loading = True
        self.model_panel.show_loading("Starting…", 0.0)
        self._update_actions()
        self._loading_options = options  # saved as the model to start with once it has loaded
        self.client.load_model.emit({**options, **self.knob_panel.values()})

    def open_download(self) -> DownloadDialog:
        """The hub download dialog, its estimates at this machine's free memory and the panel's context and knobs;
        a finished download is loaded."""
        if self.report is not None:
            free = self.report.free
        else:
            import psutil

            free = psutil.virtual_memory().available
        knobs = self.knob_panel.values()
        device = self.facts.device if self.facts is not None else "cpu"
        dialog = DownloadDialog(self, context=self.model_panel.max_seq_len.value(), free_bytes=free, device=device,
                                ratio=knobs["kv_cache_ratio"], cold_tier=knobs["cold_tier"] != "off",
                                weight_quant=self.model_panel.weights.currentData())
        dialog.downloaded.connect(self._on_downloaded)
        self.download_dialog = dialog
        dialog.open()
        return dialog

    def _on_downloaded(self, path: str) -> None:
        self.model_panel.source.setCurrentText(path)
        self.statusBar().showMessage(f"Downloaded to {path}", 8000)
        self.load_model(self.model_panel.options())

    def _on_loaded(self, facts) -> None:
        self.loading = False
        self.facts = facts
        if self._loading_options is not None:
            chosen, self._loading_options = self._loading_options, None
            if isinstance(chosen.get("max_seq_len"), int) and 0 < facts.context_limit < chosen["max_seq_len"]:
                # past the model's positions the context is capped: the panel (and next start) say what it is
                chosen = {**chosen, "max_seq_len": int(facts.context_limit)}
                self.model_panel.max_seq_len.setValue(chosen["max_seq_len"])
            self.settings.set_json(Key.MODEL, chosen)
        self.model_panel.show_loaded(facts)
        self.knob_panel.set_remote(facts.remote)
        self.statusBar().showMessage(f"{facts.display_name} ready ({facts.load_seconds:.1f} s)", 5000)
        self._update_actions()
        self._schedule_usage()  # counts the attached documents too
        self._refresh_chips()
        if self._after_load is not None:
            callback, self._after_load = self._after_load, None
            callback()

    def _on_load_failed(self, message: str, reason: str, kept=None) -> None:
        self.loading = False
        self.facts = kept  # the model that was working stays loaded and in use
        self.knob_panel.set_remote(kept.remote if kept is not None else "")
        self._after_load = None
        self._loading_options = None  # the saved choice stays the one that worked
        if kept is not None:
            self.model_panel.set_options(self.settings.model_options())  # the panel shows what runs
            self.model_panel.show_loaded(kept)
            self.model_panel.show_kept(message, kept)
        else:
            self.model_panel.show_failed(message)
        self._update_actions()
        help_text = LOAD_HELP.get(reason, "Try the default model, or check the model's files.")
        still = f"\n\n{kept.display_name} is still loaded; you can go on chatting with it." if kept is not None else ""
        self.inform("Could not load the model", f"{message}\n\nWhat to do: {help_text}{still}")

    def _on_serving(self, address: str, problem: str) -> None:
        self.model_panel.show_serving(address)
        if address:
            self.statusBar().showMessage(f"Serving {self.facts.display_name if self.facts else 'the model'} at "
                                         f"{address} (OpenAI-compatible; this machine only)", 10000)
        elif problem:
            self.inform("Serve did not start", problem)

    # ------------------------------------------------------------------ knobs
    def _on_knobs_changed(self, knobs: dict) -> None:
        if self.closed:
            return
        self.settings.set_json(Key.KNOBS, knobs)
        self._save_chat_settings()
        self._refresh_chips()
        self._schedule_usage()  # the documents' KV figures at the new values
        if self.facts is None:
            return  # used at the next load
        self._apply_knobs(knobs)

    def _on_generation_changed(self, options) -> None:
        if self.closed:
            return
        self.settings.set_json(Key.GENERATION, options.__dict__)
        self._save_chat_settings()

    # ------------------------------------------------------------------ per-chat settings and system prompt
    def _chat_settings(self) -> dict:
        return {"knobs": self.knob_panel.values(), "generation": self.knob_panel.generation().__dict__}

    def _save_chat_settings(self, conversation_id: int | None = None) -> None:
        """The open chat keeps the knobs and reply options it is used with (they come back when it is reopened)."""
        conversation_id = self.conversation_id if conversation_id is None else conversation_id
        if conversation_id is None or self.store.read_only or self._showing:
            return
        try:
            pins = self._pins(conversation_id)
            self.store.set_chat_settings(conversation_id, {**self._chat_settings(), **({"pins": pins} if pins else {})})
        except (sqlite3.Error, StoreUnavailable) as exc:
            log.warning("the chat's settings were not saved: %s", exc)

    def _pins(self, conversation_id: int | None) -> list[str]:
        """The pieces of its documents the chat keeps hot (stored with its settings; or those just asked for, which
        the engine has not answered yet: a message sent meanwhile carries them)."""
        if conversation_id in self._pins_asked:
            return list(self._pins_asked[conversation_id])
        stored = self.store.chat_settings(conversation_id) if conversation_id is not None else None
        pins = stored.get("pins") if isinstance(stored, dict) else None
        return [p for p in pins if isinstance(p, str) and p.strip()] if isinstance(pins, list) else []

    def _restore_chat_settings(self, conversation_id: int | None) -> None:
        """Opening a chat: its system prompt, and the knobs and reply options it was last used with (a chat that
        never saved any keeps what the panel shows; a new chat starts with the default system prompt)."""
        if conversation_id is None:
            self.system_prompt.set_text(self.settings.default_system_prompt())
            return
        self.system_prompt.set_text(self.store.system_prompt(conversation_id))
        stored = self.store.chat_settings(conversation_id)
        if not stored:
            return
        if isinstance(stored.get("generation"), dict):
            self.knob_panel.set_generation(GenerationOptions.from_dict(stored["generation"]))
        knobs = stored.get("knobs")
        if isinstance(knobs, dict) and K.sanitize({**self.knob_panel.values(), **knobs}) != self.knob_panel.values():
            self.knob_panel.set_values(knobs, notify=True)  # sent to the engine like a slider move
            self.knob_panel.status.setText("This chat's settings")

    def _on_system_prompt_changed(self, text: str) -> None:
        if self.closed:
            return
        if self.conversation_id is not None and not self.store.read_only:
            try:
                self.store.set_system_prompt(self.conversation_id, text)
            except (sqlite3.Error, StoreUnavailable) as exc:
                self._save_failed(f"The system prompt was not saved ({exc}).")
        self._schedule_usage()

    def _make_default_system_prompt(self, text: str) -> None:
        self.settings.set(Key.DEFAULT_SYSTEM_PROMPT, text)
        self.statusBar().showMessage("New chats will start with this system prompt." if text else
                                     "New chats will start without a system prompt.", 5000)

    def _changed_knobs(self, knobs: dict) -> dict:
        config = self.facts.config if self.facts else {}
        return {k: v for k, v in knobs.items() if config.get(k) != v} or knobs

    def _apply_knobs(self, knobs: dict) -> None:
        # Sent at once, also during a reply: the worker runs it after the turn's slot, which is what "between
        # turns" means. The panel says it is pending until the result (reconfigured) comes back.
        if self.turns.busy:
            self.knob_panel.show_pending(self._changed_knobs(knobs))
        else:
            self.knob_panel.show_applying()
        self.client.reconfigure.emit((self.conversation_id, knobs))

    def _on_reconfigured(self, result, facts) -> None:
        self.facts = facts
        self.knob_panel.show_result(result.action, result.before, result.after)
        if result.after is not None:
            self._on_memory(result.after)
        self._refresh_chips()
        self._schedule_usage()

    def _on_reconfigure_failed(self, message: str) -> None:
        self.knob_panel.show_error(message)
        self.inform("Knob not applied", message)

    def _on_rebuild_progress(self, turn_id: int, done: int, total: int) -> None:
        if turn_id == -1 and total:
            self.knob_panel.status.setText(f"Rebuilding the cache: {done:,} / {total:,} tokens…")

    # ------------------------------------------------------------------ memory and context
    def _request_memory(self) -> None:
        if self.closed:
            return
        if self.facts is not None and not self.turns.busy and not self._memory_requested:
            self._memory_requested = True
            self.client.report_memory.emit(self.conversation_id)

    def _on_memory(self, report) -> None:
        self._memory_requested = False
        self.report = report
        self.memory_panel.show_report(report)
        self._refresh_chips()
        for dialog in self.text_windows:  # a turn or the knobs changed what the cache holds: the tints follow
            self._request_heat(dialog)

    def _schedule_usage(self) -> None:
        self.usage_timer.start()

    def _request_usage(self) -> None:
        if self.closed or self.facts is None or self.turns.busy:
            return
        history = self.store.history(self.conversation_id) if self.conversation_id is not None else ()
        if self.editing_message_id is not None:
            history = self.store.history(self.conversation_id, before_message_id=self.editing_message_id)
        docs = tuple(d for d in self.attached.values() if d is not None)
        self.client.count_usage.emit(UsageRequest(self.conversation_id, history, self.composer.toPlainText(), docs,
                                                  self.knob_panel.values(), self.system_prompt.text()))

    def _on_usage(self, figures: ContextFigures) -> None:
        self.figures = figures
        self.memory_panel.show_context(figures)
        self._refresh_chips()

    # ------------------------------------------------------------------ documents
    def _documents_folder(self) -> str:
        """Where the Attach dialogs open: the folder documents were last picked from (if it is still there), else
        the home folder."""
        last = self.settings.value(Key.DOCUMENTS_FOLDER, "")
        return last if isinstance(last, str) and last and os.path.isdir(last) else str(Path.home())

    def _pick_files(self) -> None:
        paths, _ = QFileDialog.getOpenFileNames(self, "Attach documents", self._documents_folder(), ATTACH_FILTERS,
                                                ATTACH_FILTERS_DEFAULT)
        if paths:
            self.settings.set(Key.DOCUMENTS_FOLDER, os.path.dirname(paths[0]))
            self.attach_files(paths)

    def show_document_text(self, document) -> DocumentTextDialog | None:
        """A window with the text the model reads of `document` (an attached one, or a sent message's)."""
        if document is None:  # still being read
            return None
        dialog = DocumentTextDialog(document, self, self.conversation_id)
        dialog.set_pins(self._pins(self.conversation_id))
        dialog.pin_requested.connect(lambda text, d=dialog: self._send_pins(d, [*self._pins(d.conversation_id), text]))
        dialog.unpin_requested.connect(lambda d=dialog: self._send_pins(d, []))
        self.text_windows.append(dialog)
        dialog.finished.connect(lambda _r, d=dialog: self.text_windows.remove(d) if d in self.text_windows else None)
        self._request_heat(dialog)
        dialog.show()
        return dialog

    def _request_heat(self, dialog: DocumentTextDialog) -> None:
        """Ask the engine what the dialog's chat's cache holds of its text (between turns: the worker runs one thing
        at a time, so a question asked during a reply is answered after it)."""
        if dialog.conversation_id is None or self.facts is None:
            dialog.show_heat(None, "no_model" if self.facts is None else "not_held")
            return
        request_id = next(self._request_ids)
        self._heat_asked[request_id] = dialog
        self.client.report_heat.emit(HeatRequest(request_id, dialog.conversation_id, dialog.document_text))

    def _send_pins(self, dialog: DocumentTextDialog, pins: list[str]) -> None:
        """The chat's pieces kept hot from now on: the engine applies them (or refuses, changing nothing), then they
        are stored with the chat's settings and every text window of the chat shows them."""
        if dialog.conversation_id is None:
            return
        pins = list(dict.fromkeys(pins))  # each piece once, in the order kept
        request_id = next(self._request_ids)
        self._pin_asked[request_id] = (dialog.conversation_id, pins)
        self._pins_asked[dialog.conversation_id] = pins
        self.client.set_pins.emit(PinRequest(request_id, dialog.conversation_id, tuple(pins)))

    def _on_pinned(self, request_id: int, missing, error: str, why: str) -> None:
        asked = self._pin_asked.pop(request_id, None)
        if asked is None or self.closed:
            return
        conversation_id, pins = asked
        if self._pins_asked.get(conversation_id) is pins:
            del self._pins_asked[conversation_id]  # the store says from now on
        if error:
            self.inform("Could not keep it hot", error)
            return
        if why in ("no_model", "remote"):
            self.inform("Could not keep it hot", "The model runs on a server other than DS-V4.1's: its cache is not visible from here."
                        if why == "remote" else "Load a model first: the pieces kept hot are kept by its cache.")
            return
        try:
            stored = self.store.chat_settings(conversation_id) or {}  # (that chat's knobs, not the panel's)
            self.store.set_chat_settings(conversation_id, {**stored, "pins": pins})
        except (sqlite3.Error, StoreUnavailable) as exc:
            self.inform("Could not keep it hot", f"The chat's settings could not be saved: {exc}")
            return
        for dialog in self.text_windows:
            if dialog.conversation_id == conversation_id:
                dialog.set_pins(pins)
                self._request_heat(dialog)
        if why == "not_loaded":
            self.statusBar().showMessage("Kept for this chat: its cache keeps it hot from your next question on.",
                                         10_000)
        elif missing:
            self.statusBar().showMessage(f"{len(missing)} piece(s) kept hot are not in the text the chat has read "
                                         "yet: looked for again after each question.", 10_000)
        elif pins:
            self.statusBar().showMessage("Kept hot: later questions about other parts do not push it out.", 10_000)
        else:
            self.statusBar().showMessage("Nothing is pinned: the cache decides again what stays hot.", 10_000)

    def _on_heat(self, request_id: int, heat, why: str) -> None:
        dialog = self._heat_asked.pop(request_id, None)
        if dialog is not None and dialog in self.text_windows:
            dialog.show_heat(heat, why)

    def show_document_memory(self) -> list:
        """The text windows of the documents sent with the chat's last message that had any (Chat menu): what the
        cache holds of each, tinted. Says how to get there in a chat without documents."""
        messages = self.store.messages(self.conversation_id) if self.conversation_id is not None else []
        sent = next((m for m in reversed(messages) if m.role == "user" and m.attachments), None)
        if sent is None:
            self.inform("No documents in this chat", "Attach a document (Ctrl+O, or drop it on the window) and ask "
                        "about it: this then shows its text tinted by what the cache holds of it, and lets you keep "
                        "parts of it hot.", icon=QMessageBox.Icon.Information)
            return []
        return [self.show_document_text(document) for document in self.store.attachments(sent.id)]

    def _show_sent_document(self, message_id: int, index: int) -> None:
        documents = self.store.attachments(message_id) if message_id else ()
        if 0 <= index < len(documents):
            self.show_document_text(documents[index])

    def _pick_folder(self) -> None:
        folder = QFileDialog.getExistingDirectory(self, "Attach the documents of a folder", self._documents_folder())
        if folder:
            self.settings.set(Key.DOCUMENTS_FOLDER, os.path.dirname(os.path.normpath(folder)))
            self.attach_files([folder])

    def attach_files(self, paths: list[str]) -> None:
        """Read each file as a document (in the loader's threads); a folder gives the documents inside it, listed
        there too (its chip stands for them until then)."""
        for path in paths:
            key = self.loader.list_folder(path) if os.path.isdir(path) else self.loader.load(path)
            self._doc_paths[key] = path
            self.attached[key] = None
            self.chips.add_pending(key, path)
        self._update_actions()

    def _on_folder_listed(self, key: str, found) -> None:
        """A dropped folder's documents: each read in its place (the chip of the folder goes), and what was left out
        said. A folder whose chip was set aside with its draft fills that draft; one removed meanwhile adds nothing."""
        self._doc_paths.pop(key, None)
        target = None  # the box's documents
        if key in self.attached:
            self.attached.pop(key)
            self.chips.remove(key)
        else:
            target = next((documents for documents in self._set_aside_documents() if key in documents), None)
            if target is None:
                return
            target.pop(key)
        said = found.summary()
        if said and not found.files:
            self.inform("Could not attach the folder", said)
        elif said:
            self.statusBar().showMessage(said, 15_000)
        for path in found.files:
            document_key = self.loader.load(path)
            self._doc_paths[document_key] = path
            if target is None:
                self.attached[document_key] = None
                self.chips.add_pending(document_key, path)
            else:
                target[document_key] = None
        self._update_actions()

    def _on_document_parsed(self, key: str, doc: AttachedDocument) -> None:
        self._doc_paths.pop(key, None)  # the document names its path from now on
        if key not in self.attached:  # set aside with its chat's (or an edit's) draft, or removed while read
            for documents in self._set_aside_documents():
                if key in documents:
                    documents[key] = doc
            return
        self.attached[key] = doc
        self.chips.chips[key].show_document(doc)
        self._refresh_chips()
        self._schedule_usage()  # the engine counts it
        self._update_actions()

    def _on_document_failed(self, key: str, path: str, message: str) -> None:
        self._doc_paths.pop(key, None)
        self.attached.pop(key, None)
        for documents in self._set_aside_documents():
            documents.pop(key, None)
        self.chips.remove(key)
        self._update_actions()
        box = self._attach_failures
        if box is not None and box in self.open_dialogs:  # several files failed (a folder's): one message for all
            self._attach_failed += 1
            self.shown_messages.append(("Could not attach the file", message))
            box.setWindowTitle(f"Could not attach {self._attach_failed} files")
            box.setText(box.text() + "\n\n" + message)
            return
        self._attach_failures, self._attach_failed = self.inform("Could not attach the file", message), 1

    def _on_document_figures(self, figures: tuple[DocumentFigures, ...]) -> None:
        for item in figures:
            self.doc_figures[item.key] = item
            self.doc_tokens[item.key] = item.tokens
        self._refresh_chips()

    def remove_document(self, key: str) -> None:
        self.attached.pop(key, None)
        self.chips.remove(key)
        self._schedule_usage()
        self._update_actions()

    def _refresh_chips(self) -> None:
        """Each chip's figures: the engine's (DocumentFigures) once they came, an estimate until then."""
        knobs = self.knob_panel.values()
        before = (self.figures.system + self.figures.history + self.figures.prompt) if self.figures else 0
        for key, doc in self.attached.items():
            chip = self.chips.chips.get(key)
            if doc is None or chip is None:
                continue
            figures = self.doc_figures.get(key)
            tokens = figures.tokens if figures is not None else doc.estimated_tokens
            if self.facts is None:
                chip.show_figures(tokens, figures is not None, None, None, None)
                continue
            fit = assess_fit(tokens, tokens_before=before, context_limit=self.facts.context_limit,
                             max_positions=self.facts.max_positions,
                             kv_bytes=figures.kv_bytes if figures is not None else None,
                             kv_after=figures.kv_after if figures is not None else None,
                             bytes_per_token=self.facts.kv_bytes_per_token,
                             free_bytes=self.report.free if self.report and not self.report.remote else None,
                             prefill_headroom=knobs["prefill_headroom"], kv_dtype=knobs["kv_cache_dtype"])
            chip.show_figures(tokens, figures is not None, fit.kv_bytes,
                              figures.kv_cache_ratio if figures is not None else None, fit.warning)
            before += tokens

    # ------------------------------------------------------------------ conversations
    def _reload_conversations(self, select: int | None = None) -> None:
        conversations = self.store.conversations(self.conversations.search.text())
        ids = [c.id for c in conversations]
        target = select if select in ids else (self.conversation_id if self.conversation_id in ids else None)
        self.conversations.populate(conversations, target)
        if target is not None and target != self.conversation_id:
            self.show_conversation(target)
        elif (target is None and self.conversation_id is None and ids and not self.conversations.search.text()
              and not self._new_chat):
            self.show_conversation(ids[0])
            self.conversations.select(ids[0])

    def show_conversation(self, conversation_id: int | None) -> None:
        if conversation_id is not None and self.store.conversation(conversation_id) is None:
            conversation_id = None
        self.cancel_edit()
        self.system_prompt.flush()  # an edit still waiting belongs to the chat being left
        self.knob_panel.flush()  # so does a knob change still waiting
        self._new_chat = False
        changed = conversation_id != self.conversation_id
        if changed:
            self._switch_draft(conversation_id)
        self.conversation_id = conversation_id
        if changed or conversation_id is None:
            self._showing = True
            try:
                self._restore_chat_settings(conversation_id)
            finally:
                self._showing = False
        self.settings.set(Key.LAST_CONVERSATION, conversation_id if conversation_id is not None else "")
        self.turns.save_now()
        self.chat.clear()
        if conversation_id is not None:
            for m in self.store.messages(conversation_id):
                footer = reply_footer(m.stats, m.status, m.finish_reason) if m.role == "assistant" else ""
                bubble = MessageBubble(m.role, m.content, message_id=m.id, attachments=m.attachments, footer=footer,
                                       error=m.error, created=m.created)
                self.chat.add(bubble)
            replies = [b for b in self.chat.bubbles if b.role == "assistant"]
            if replies and self.chat.bubbles[-1] is replies[-1]:  # the last reply: its versions (regenerate)
                versions = self.store.versions(replies[-1].message_id)
                replies[-1].set_versions(versions.index(replies[-1].message_id) + 1, len(versions))
        self.turns.rebind(self.chat.bubbles)
        if self.turns.active is not None and self.turns.active.bubble is not None:
            self.turns.active.bubble.set_text(self.turns.active.text)
        self.chat.highlight(self.conversations.search.text().strip())  # a chat opened from a search: its match
        self._update_actions()
        self._schedule_usage()

    def _on_search(self) -> None:
        """The chats list shows the chats holding the search's text; the open chat marks it (or clears the marks)."""
        self._reload_conversations(select=self.conversation_id)
        self.chat.highlight(self.conversations.search.text().strip())

    def new_conversation(self) -> None:
        self.conversations.list.clearSelection()
        self.conversations.list.setCurrentItem(None)
        self.show_conversation(None)
        self._new_chat = True
        self.composer.setFocus()

    def delete_conversation(self, conversation_id: int) -> None:
        if self.turns.active is not None and self.turns.active.conversation_id == conversation_id:
            self.inform("Delete refused", "This chat is still generating a reply. Stop it first.")
            return
        conv = self.store.conversation(conversation_id)
        if conv is None or not self.confirm("Delete chat", f"Delete “{conv.title}” and all its messages?"):
            return
        try:
            self.store.check_writable()
            self.store.delete(conversation_id)
        except (sqlite3.Error, StoreUnavailable) as exc:
            self._save_failed(f"The chat was not deleted ({exc}).")
            return
        self.client.forget_conversation.emit(conversation_id)
        self._drafts.pop(conversation_id, None)  # its message box goes with it
        if self.conversation_id == conversation_id:
            self.conversation_id = None
            self.show_conversation(None)
            self._clear_box()
        self._reload_conversations()

    def _on_renamed(self, conversation_id: int, title: str) -> None:
        try:
            self.store.check_writable()
            self.store.rename(conversation_id, title)
        except (sqlite3.Error, StoreUnavailable) as exc:
            self._save_failed(f"The chat was not renamed ({exc}).")
        conv = self.store.conversation(conversation_id)
        if conv is not None:
            self.conversations.set_title(conversation_id, conv.title)

    def export_conversation(self, conversation_id: int, fmt: str, path: str | None = None) -> str | None:
        conv = self.store.conversation(conversation_id)
        if conv is None:
            return None
        if path is None:
            suggested = "".join(c if c.isalnum() or c in " -_" else "_" for c in conv.title).strip() or "chat"
            filters = "Markdown (*.md)" if fmt == "md" else "JSON (*.json)"
            path, _ = QFileDialog.getSaveFileName(self, "Export chat", str(export_folder() / f"{suggested}.{fmt}"),
                                                  filters)
            if not path:
                return None
        try:
            if fmt == "md":
                Path(path).write_text(self.store.export_markdown(conversation_id), encoding="utf-8")
            else:
                Path(path).write_text(json.dumps(self.store.export_json(conversation_id), ensure_ascii=False,
                                                 indent=2), encoding="utf-8")
        except OSError as exc:
            self.inform("Export failed", f"Could not write {path}: {exc.strerror or exc}")
            return None
        self.statusBar().showMessage(f"Exported to {path}", 5000)
        return path

    def _pick_chat_to_import(self) -> None:
        path, _ = QFileDialog.getOpenFileName(self, "Import a chat", str(export_folder()),
                                              "Chat exports (*.json);;All files (*)")
        if path:
            self.import_chat(path)

    def duplicate_conversation(self, conversation_id: int, through: int | None = None) -> int | None:
        """A copy of the chat, to ask it other things from the same point (the same document, the same exchanges):
        a new chat with its messages (up to and with the message `through`: a branch), documents and settings,
        opened; its saved cache is the original's (found by what it holds), so its next question does not re-read
        the conversation."""
        try:
            chat = parse_export(self.store.export_json(conversation_id))
            if through is not None:
                ids = [m.id for m in self.store.messages(conversation_id)]
                chat.messages = chat.messages[:ids.index(through) + 1] if through in ids else chat.messages
            chat.title = f"{chat.title} ({'branch' if through is not None else 'copy'})"
            copy = self.store.import_chat(chat)
        except KeyError:
            return None
        except (StoreUnavailable, sqlite3.Error) as exc:
            self._save_failed(f"The chat was not duplicated ({exc}).")
            return None
        self._open_added_chat(copy)
        return copy

    def _open_added_chat(self, conversation_id: int) -> None:
        """A chat just written to the store (imported, duplicated): listed and opened."""
        self._new_chat = False
        self._reload_conversations(select=conversation_id)
        self.conversations.select(conversation_id)

    def import_chat(self, path: str) -> int | None:
        """A chat exported as JSON made a new chat and opened; the new chat's id, or None (said why)."""
        try:
            chat = read_export(path)
            conversation_id = self.store.import_chat(chat)
        except ChatImportError as exc:
            self.inform("Could not import the chat", str(exc))
            return None
        except (StoreUnavailable, sqlite3.Error) as exc:
            self._save_failed(f"The chat was not imported ({exc}).")
            return None
        self._open_added_chat(conversation_id)
        said = f'Imported "{chat.title}" ({len(chat.messages)} messages).'
        if chat.notes:
            self.inform("Chat imported", " ".join([said, *chat.notes]), icon=QMessageBox.Icon.Information)
        else:
            self.statusBar().showMessage(said, 8000)
        return conversation_id

    # ------------------------------------------------------------------ turns
    def send(self) -> None:
        # trailing space and blank lines around the message go; the first line's indentation (code) stays
        prompt = self.composer.toPlainText().rstrip().lstrip("\n")
        if self.turns.busy:
            return
        if not prompt.strip():
            if self.attached:  # a document alone is not a question: say what Send waits for
                self.statusBar().showMessage("Type a question about the attached document, then send.", 10000)
                self.composer.setFocus()
            return
        self.knob_panel.flush()  # a knob moved just before: this turn reads with it, as its settings will say
        if self.statusBar().currentMessage() == WITHDRAWN_NOTICE:
            self.statusBar().clearMessage()  # it was about the message now being sent
        if self.store.read_only:
            self.inform("Chats cannot be saved", self.store.problem + "\n\nYour message is still in the box.")
            return
        if self.facts is None or self.loading:
            why = "The model is still loading; send again when it is ready." if self.loading else \
                "No model is loaded. Pick one in the model bar and press Load."
            self.inform("No model", why)
            return
        if any(doc is None for doc in self.attached.values()):
            self.inform("Still reading documents", "Wait until the attached documents are read, then send.")
            return
        documents = tuple(self.attached.values())
        # Nothing the user typed is lost: the composer is cleared only once the message is saved.
        created = None
        try:
            self.system_prompt.flush()
            if self.conversation_id is None:
                created = self.store.create_conversation(_title_from(prompt))
                self.store.set_system_prompt(created, self.system_prompt.text())
                self.store.set_chat_settings(created, self._chat_settings())
            conversation = created if created is not None else self.conversation_id
            if self.editing_message_id is not None:
                history = self.store.history(conversation, before_message_id=self.editing_message_id)
            else:
                history = self.store.history(conversation)
            self._start_turn(prompt, documents, history, conversation, replace_from=self.editing_message_id)
        except Exception as exc:  # noqa: BLE001 - whatever failed, no chat is left behind without its message
            if created is not None:
                try:
                    self.store.delete(created)
                except sqlite3.Error:
                    pass
            why = "it could not be saved" if isinstance(exc, (sqlite3.Error, StoreUnavailable)) else "it failed"
            self._save_failed(f"Your message was not sent: {why} ({exc}).\n\nIt is still in the message box.")
            return
        if created is not None:
            self.conversation_id = created
            self.settings.set(Key.LAST_CONVERSATION, created)
        draft = None
        if self.editing_message_id is not None:
            self._set_editing(None)
            draft, self._draft = self._draft, None
            self.show_conversation(self.conversation_id)  # the replaced messages leave the view
        if created is not None:
            self._reload_conversations(select=created)
        self.composer.clear()
        self.attached.clear()
        self.chips.clear()
        self._put_back(draft)  # what was typed before the edit began
        self._update_actions()

    def _save_failed(self, message: str) -> None:
        where = self.store.path.parent
        self.inform("Could not save", f"{message}\n\nThe chats are kept in {where}. Free some space on that disk "
                    "(or make the folder writable), then send again.")

    def _start_turn(self, prompt: str, documents, history, conversation_id: int | None = None, *,
                    replace_from: int | None = None, version_of: int | None = None) -> None:
        conversation_id = self.conversation_id if conversation_id is None else conversation_id
        self.turns.start(conversation_id, prompt, documents, dict(self.doc_tokens), self.knob_panel.generation(),
                         self._reply_settings(), history, replace_from=replace_from,
                         system_prompt=self.store.system_prompt(conversation_id), version_of=version_of,
                         pins=tuple(self._pins(conversation_id)))
        self.settings.set_json(Key.GENERATION, self.knob_panel.generation().__dict__)
        self._update_actions()

    def _reply_settings(self) -> dict:
        facts = self.facts
        # the panel's knobs: sent before this turn, the worker applies them before it reads it (facts.config may
        # not have caught up with a change still being applied)
        knobs = {k: v for k, v in self.knob_panel.values().items() if k in K.KNOB_NAMES} if facts else {}
        return {"model": facts.display_name, "source": facts.source, "weight_quant": facts.weight_quant,
                "device": facts.device, "dtype": facts.dtype, "attention": facts.attention_backend,
                "attention_kernels": facts.attention_kernels,
                "max_seq_len": facts.config.get("max_seq_len"), "knobs": knobs,
                "system_prompt": self.system_prompt.text(),
                "generation": self.knob_panel.generation().__dict__}

    def stop(self) -> None:
        self.turns.stop()
        self.stop_button.setEnabled(False)

    def _last_user_message(self):
        if self.conversation_id is None:
            return None
        return next((m for m in reversed(self.store.messages(self.conversation_id)) if m.role == "user"), None)

    def regenerate(self) -> None:
        if self.turns.busy or self.facts is None:
            return
        user = self._last_user_message()
        if user is None:
            return
        if self.store.read_only:
            self.inform("Chats cannot be saved", self.store.problem)
            return
        self.knob_panel.flush()  # a knob moved just before: the new version reads with it
        documents = self.store.attachments(user.id)
        history = self.store.history(self.conversation_id, before_message_id=user.id)
        try:
            self._start_turn(user.content, documents, history, version_of=user.id)
        except (sqlite3.Error, StoreUnavailable) as exc:
            self._save_failed(f"The reply was not regenerated: it could not be saved ({exc}).")
            return
        self.show_conversation(self.conversation_id)  # the earlier reply becomes a version: the view shows the new one

    def edit_last(self) -> None:
        user = self._last_user_message()
        if user is not None:
            self.edit_message(user.id)

    def edit_message(self, message_id: int) -> None:
        """Put a message of yours back in the box: Send replaces it, and what came after it is removed (the chat
        continues from the edited message)."""
        if self.turns.busy or self.conversation_id is None:
            return
        user = next((m for m in self.store.messages(self.conversation_id) if m.id == message_id and m.role == "user"),
                    None)
        if user is None:
            return
        if self.editing_message_id is None and (self.composer.toPlainText().strip() or self.attached):
            self._draft = (self.composer.toPlainText(), dict(self.attached))  # nothing typed is lost
        self.composer.setPlainText(user.content)
        self.attached.clear()
        self.chips.clear()
        for doc in self.store.attachments(user.id):
            self.attached[doc.key] = doc
            self.chips.add_pending(doc.key, doc.path).show_document(doc)
        self._set_editing(user.id)  # asks for the usage, which counts them
        self._refresh_chips()
        self.composer.setFocus()

    def cancel_edit(self) -> None:
        if self.editing_message_id is not None:
            self._set_editing(None)
            self.composer.clear()
            self.attached.clear()
            self.chips.clear()
            draft, self._draft = self._draft, None
            self._put_back(draft)

    def _put_back(self, draft: tuple[str, dict] | None) -> None:
        """A draft set aside (by an edit, or with its chat) back in the box, with its documents."""
        if draft is None:
            return
        text, documents = draft
        self.composer.setPlainText(text)
        for key, doc in documents.items():
            self.attached[key] = doc
            chip = self.chips.add_pending(key, doc.path if doc is not None else self._doc_paths.get(key, key))
            if doc is not None:
                chip.show_document(doc)
        self._refresh_chips()

    def _clear_box(self) -> None:
        self.composer.clear()
        self.attached.clear()
        self.chips.clear()

    def _switch_draft(self, target: int | None) -> None:
        """The message box belongs to its chat: what is in it (text and documents) is set aside with the chat being
        left, and the target chat's comes back (an empty box for a chat without one). A new chat's unsent message
        is kept under None: the next New chat starts with it."""
        text, documents = self.composer.toPlainText(), dict(self.attached)
        if text.strip() or documents:
            self._drafts[self.conversation_id] = (text, documents)
        self._clear_box()
        self._put_back(self._drafts.pop(target, None))

    def _set_aside_documents(self) -> list[dict]:
        """The documents of the drafts not in the box (other chats', the one an edit set aside): a document still
        being read is filled in (or dropped, when it cannot be read) there."""
        drafts = [*self._drafts.values(), *([self._draft] if self._draft is not None else [])]
        return [documents for _text, documents in drafts]

    def _set_editing(self, message_id: int | None) -> None:
        self.editing_message_id = message_id
        if message_id is not None:
            later = sum(1 for m in self.store.messages(self.conversation_id) if m.id > message_id)
            after = f" and the {later} messages after it" if later > 1 else " and its reply" if later else ""
            self.edit_banner.setText(f"✎ Editing a message: Send replaces it{after} · Esc cancels")
        self.edit_banner.setVisible(message_id is not None)
        self._schedule_usage()

    def _on_message_action(self, action: str, message_id: int) -> None:
        if self.turns.busy:
            self.inform("Not now", "A reply is being generated. Stop it (Esc) or wait for it to finish, then change "
                        "the chat.")
            return
        if action == "edit":
            self.edit_message(message_id)
        elif action == "delete":
            self.delete_message(message_id)
        elif action == "branch":
            self.duplicate_conversation(self.conversation_id, through=message_id)
        elif action in ("previous", "next"):
            versions = self.store.versions(message_id)
            index = versions.index(message_id) + (1 if action == "next" else -1)
            if 0 <= index < len(versions):
                self._change_chat(self.store.select_version, versions[index])

    def delete_message(self, message_id: int) -> None:
        message = next((m for m in self.store.messages(self.conversation_id) if m.id == message_id), None)
        if message is None:
            return
        what = "this message and its reply" if message.role == "user" else "this reply"
        if self.confirm("Delete message", f"Delete {what}? The chat is read again without it at the next turn."):
            self._change_chat(self.store.delete_message, message_id)

    def _change_chat(self, change, *args) -> None:
        """A change to the transcript (a version chosen, a message deleted): saved, shown, and read by the engine
        at the next turn (restored from the chat's saved cache where it can, otherwise re-read)."""
        try:
            self.store.check_writable()
            change(*args)
        except (sqlite3.Error, StoreUnavailable) as exc:
            self._save_failed(f"The chat was not changed ({exc}).")
            return
        self.cancel_edit()
        self.show_conversation(self.conversation_id)
        self._reload_conversations(select=self.conversation_id)

    def _on_turn_finished(self, outcome, turn) -> None:
        self._update_actions()
        self._reload_conversations(select=self.conversation_id)
        if outcome.error_kind == "oom":
            self._offer_oom_retry(outcome.error)
        elif outcome.error:
            self.inform("The reply ended with an error", outcome.error)
        self._schedule_usage()

    def _on_turn_refused(self, outcome, turn) -> None:
        # Nothing happened: put the question and its documents back so the user can adjust and resend.
        self._put_turn_back(turn)
        titles = {"overflow": "Does not fit the context", "document": "Could not read a document",
                  "no_model": "No model", "busy": "Busy"}
        self.inform(titles.get(outcome.error_kind, "Could not send"), outcome.error or "The engine refused the turn.")
        self._schedule_usage()

    def _on_turn_withdrawn(self, outcome, turn) -> None:
        # Stopped before the reply began: the engine kept nothing, so neither does the chat; the message is back.
        here = turn.conversation_id == self.conversation_id  # (an emptied new chat is gone after the put-back)
        self._put_turn_back(turn)
        if here and not turn.new_version:
            self.statusBar().showMessage(WITHDRAWN_NOTICE, 10000)
        self._schedule_usage()

    def _put_turn_back(self, turn) -> None:
        """A turn that left nothing behind: its rows are gone; its question and documents go back in the box."""
        if turn.new_version and turn.conversation_id == self.conversation_id:
            self.show_conversation(self.conversation_id)  # the reply shown before is shown again
        if (turn.conversation_id == self.conversation_id and not turn.new_version
                and not self.composer.toPlainText().strip()):
            self.composer.setPlainText(turn.prompt)
            for doc in turn.documents:
                if doc.key not in self.attached:
                    self.attached[doc.key] = doc
                    self.chips.add_pending(doc.key, doc.path).show_document(doc)
            self._refresh_chips()
        elif turn.conversation_id != self.conversation_id and not turn.new_version:
            text, documents = self._drafts.get(turn.conversation_id, ("", {}))
            if not text.strip():  # another chat is shown: the message goes back in its chat's box
                self._drafts[turn.conversation_id] = (turn.prompt, {**documents,
                                                                    **{doc.key: doc for doc in turn.documents}})
        if not self.store.messages(turn.conversation_id) and self.store.conversation(turn.conversation_id):
            try:
                self.store.delete(turn.conversation_id)
                kept = self._drafts.pop(turn.conversation_id, None)
                if kept is not None and self.conversation_id != turn.conversation_id and None not in self._drafts:
                    self._drafts[None] = kept  # the new chat it was for is gone: the next New chat starts with it
            except sqlite3.Error:
                pass  # an empty chat stays in the list; nothing is lost
            if self.conversation_id == turn.conversation_id:
                self.conversation_id = None
                self._new_chat = True  # the user stays in the new chat their message was for
            self._reload_conversations()
        self._update_actions()

    def _offer_oom_retry(self, message: str) -> None:
        def compress_and_retry():
            knobs = self.knob_panel.values()
            harder = {**knobs, "kv_cache_ratio": max(round(knobs["kv_cache_ratio"] / 2, 2), MIN_SUGGESTED_RATIO),
                      "ced_threshold": min(round(knobs["ced_threshold"] + 0.1, 2), K.SLIDER["ced_threshold"].maximum),
                      "kv_cache_dtype": "int8"}
            self.knob_panel.set_values(harder)
            self.settings.set_json(Key.KNOBS, self.knob_panel.values())
            self._apply_knobs(self.knob_panel.values())
            self.regenerate()

        def shorter_context_and_retry():
            current = self.facts.context_limit if self.facts else self.model_panel.max_seq_len.value()
            self.model_panel.max_seq_len.setValue(max(current // 2, 1024))
            self._after_load = self.regenerate
            self.load_model(self.model_panel.options())

        self.inform("Out of memory", f"{message}\n\nThe partial reply is kept.", buttons=[
            ("Compress harder and retry", QMessageBox.ButtonRole.AcceptRole, compress_and_retry),
            ("Lower max_seq_len and retry", QMessageBox.ButtonRole.AcceptRole, shorter_context_and_retry),
            ("Keep the partial reply", QMessageBox.ButtonRole.RejectRole, None)])

    def _update_actions(self) -> None:
        busy = self.turns.busy if hasattr(self, "turns") else False
        for bubble in self.chat.bubbles:
            bubble.set_actions_enabled(not busy)
        ready = self.facts is not None and not self.loading
        has_messages = bool(self.chat.bubbles)
        self.send_button.setEnabled(not busy and ready)
        self.stop_button.setEnabled(busy)
        self.regenerate_button.setEnabled(not busy and ready and has_messages)
        self.edit_button.setEnabled(not busy and has_messages)
        self.model_panel.load_button.setEnabled(not busy and not self.loading)
        if busy:
            self.send_button.setToolTip("A reply is being generated")
        elif not ready:
            self.send_button.setToolTip("Loading the model…" if self.loading else "Load a model first")
        else:
            self.send_button.setToolTip("Send (Enter)")

    # ------------------------------------------------------------------ drag and drop
    def dragEnterEvent(self, event) -> None:  # noqa: N802 - Qt override
        if event.mimeData().hasUrls():
            event.acceptProposedAction()

    def dragMoveEvent(self, event) -> None:  # noqa: N802 - Qt override
        if event.mimeData().hasUrls():
            event.acceptProposedAction()

    def dropEvent(self, event) -> None:  # noqa: N802 - Qt override
        paths = [url.toLocalFile() for url in event.mimeData().urls() if url.isLocalFile()]
        if paths:
            event.acceptProposedAction()
            self.attach_files(paths)

    # ------------------------------------------------------------------ settings and shutdown
    def _restore_settings(self) -> None:
        geometry = self.settings.state(Key.GEOMETRY)
        if geometry:
            self.restoreGeometry(geometry)
        splitter = self.settings.state(Key.SPLITTER)
        if splitter:
            self.splitter.restoreState(splitter)
        self.model_panel.set_options(self.settings.model_options())
        self.knob_panel.set_values(self.settings.knobs())
        self.knob_panel.set_generation(self.settings.generation())
        self.set_text_size(text_size.sanitize(self.settings.value(Key.TEXT_SIZE, text_size.ACTUAL)))

    def _restore_draft(self) -> None:
        """What was in the message box when the window closed, back in it (in its chat; documents still there), and
        the other chats' boxes set aside with them."""
        draft = self.settings.json(Key.DRAFT, None)
        self.settings.set_json(Key.DRAFT, None)
        if not isinstance(draft, dict):
            return
        others = draft.get("others") if isinstance(draft.get("others"), list) else []
        for saved in [*others, draft]:
            if isinstance(saved, dict):
                self._set_aside_draft(saved)
        chat = draft.get("conversation")
        if not (chat is None or isinstance(chat, int) and not isinstance(chat, bool)) or chat not in self._drafts:
            return  # nothing in it, or its chat is gone (or a damaged value)
        if chat == self.conversation_id:
            self._put_back(self._drafts.pop(chat))
        elif chat is None:
            self.new_conversation()
        else:
            self.show_conversation(chat)
            self.conversations.select(chat)

    def _draft_paths(self, documents: dict) -> list[str]:
        """The files of a draft's documents, those still being read included."""
        paths = [doc.path if doc is not None else self._doc_paths.get(key) for key, doc in documents.items()]
        return [p for p in paths if p]

    def _set_aside_draft(self, saved: dict) -> None:
        """A chat's box from the last run, set aside with its chat (its documents read again meanwhile) when the chat
        is still there (None: a new chat's, which the next New chat starts with)."""
        chat, text = saved.get("conversation"), str(saved.get("text", ""))
        if chat is not None and (not isinstance(chat, int) or isinstance(chat, bool) or not 0 < chat < 2**63
                                 or self.store.conversation(chat) is None) or chat in self._drafts:
            return
        documents = saved.get("documents") if isinstance(saved.get("documents"), list) else []
        paths = [p for p in documents if isinstance(p, str) and (Path(p).is_file() or Path(p).is_dir())]
        if not text.strip() and not paths:
            return
        documents: dict = {}
        for path in paths:  # a folder: one saved while its documents were still being listed
            key = self.loader.list_folder(path) if Path(path).is_dir() else self.loader.load(path)
            self._doc_paths[key] = path
            documents[key] = None  # filled in when read (_on_document_parsed)
        self._drafts[chat] = (text, documents)

    def save_settings(self) -> None:
        text, documents = self.composer.toPlainText(), self.attached
        if self.editing_message_id is not None:  # the box holds the message being edited: the draft is aside
            text, documents = self._draft if self._draft is not None else ("", {})
        paths = self._draft_paths(documents)
        others = [{"conversation": chat, "text": t, "documents": self._draft_paths(docs)}
                  for chat, (t, docs) in self._drafts.items() if chat != self.conversation_id]
        self.settings.set_json(Key.DRAFT, {"conversation": self.conversation_id, "text": text, "documents": paths,
                                           "others": others} if text.strip() or paths or others else None)
        self.settings.set(Key.GEOMETRY, self.saveGeometry())
        self.settings.set(Key.SPLITTER, self.splitter.saveState())
        self.settings.set_json(Key.KNOBS, self.knob_panel.values())
        self.settings.set_json(Key.GENERATION, self.knob_panel.generation().__dict__)
        self.settings.sync()

    def closeEvent(self, event) -> None:  # noqa: N802 - Qt override
        if self.closed:
            super().closeEvent(event)
            return
        self.system_prompt.flush()  # edits still waiting for their pause are the chat's, as when switching chats
        self.knob_panel.flush()
        self.closed = True
        self.memory_timer.stop()
        self.usage_timer.stop()
        self.conversations.cancel_pending()
        turn = self.turns.withdraw_unanswered()
        if turn is not None:  # closed before its reply began: as a stop then, nothing kept and the message back
            self._put_turn_back(turn)
        self.save_settings()
        self.turns.save_now()
        started = time.monotonic()
        self.client.shutdown()
        self.loader.wait(5000)
        log.debug("worker stopped in %.2f s", time.monotonic() - started)
        if self.turns.active is not None:
            try:
                self.store.finish_reply(self.turns.active.reply_id, self.turns.active.text, "stopped")
            except sqlite3.Error:
                log.warning("could not save the reply being streamed at exit")
            self.turns.active = None
        self.store.close()
        super().closeEvent(event)


def export_folder() -> Path:
    """Where the export dialog opens: the user's documents folder (the home folder where there is none)."""
    from PySide6.QtCore import QStandardPaths

    folder = QStandardPaths.writableLocation(QStandardPaths.StandardLocation.DocumentsLocation)
    return Path(folder) if folder and Path(folder).is_dir() else Path.home()


def _title_from(prompt: str, limit: int = 48) -> str:
    line = " ".join(prompt.split())
    return line if len(line) <= limit else line[: limit - 1].rstrip() + "…"
