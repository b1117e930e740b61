"""The conversation list: search, new, rename (in place), delete, export."""

from __future__ import annotations

from PySide6.QtCore import Qt, QTimer, Signal
from PySide6.QtWidgets import (
    QAbstractItemView,
    QHBoxLayout,
    QLineEdit,
    QListWidget,
    QListWidgetItem,
    QMenu,
    QPushButton,
    QVBoxLayout,
    QWidget,
)

from . import fit_to_text

ID_ROLE = Qt.ItemDataRole.UserRole


class ConversationList(QWidget):
    selected = Signal(int)  # conversation id
    new_requested = Signal()
    delete_requested = Signal(int)
    renamed = Signal(int, str)
    export_requested = Signal(int, str)  # id, "md" | "json"
    duplicate_requested = Signal(int)  # a copy of the chat to go on from in another direction

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.setObjectName("conversationList")
        layout = QVBoxLayout(self)
        layout.setContentsMargins(6, 6, 6, 6)
        self.new_button = QPushButton("＋ New chat")
        self.new_button.setObjectName("newChat")
        self.new_button.clicked.connect(self.new_requested)
        layout.addWidget(self.new_button)
        self.search = QLineEdit()
        self.search.setPlaceholderText("Search chats…")
        self.search.setClearButtonEnabled(True)
        layout.addWidget(self.search)
        self.list = QListWidget()
        self.list.setSelectionMode(QAbstractItemView.SelectionMode.SingleSelection)
        self.list.setEditTriggers(QAbstractItemView.EditTrigger.EditKeyPressed)
        self.list.setContextMenuPolicy(Qt.ContextMenuPolicy.CustomContextMenu)
        self.list.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.list.setTextElideMode(Qt.TextElideMode.ElideRight)
        self.list.setUniformItemSizes(True)
        self.list.customContextMenuRequested.connect(self._menu)
        self.list.currentItemChanged.connect(self._on_current)
        self.list.itemChanged.connect(self._on_item_changed)
        layout.addWidget(self.list, 1)
        row = QHBoxLayout()
        self.rename_button = QPushButton("Rename")
        self.rename_button.clicked.connect(self.start_rename)
        self.delete_button = QPushButton("Delete")
        self.delete_button.clicked.connect(self._delete_current)
        self.export_button = QPushButton("Export")
        export_menu = QMenu(self.export_button)
        export_menu.addAction("As Markdown…", lambda: self._export("md"))
        export_menu.addAction("As JSON…", lambda: self._export("json"))
        self.export_button.setMenu(export_menu)
        for button in (self.rename_button, self.delete_button, self.export_button):
            fit_to_text(button)
            row.addWidget(button)
        layout.addLayout(row)
        self._populating = False
        self._search_timer = QTimer(self, singleShot=True, interval=200)
        self.search.textChanged.connect(lambda _t: self._search_timer.start())
        self.search_changed = self._search_timer.timeout

    def cancel_pending(self) -> None:
        self._search_timer.stop()

    # ------------------------------------------------------------------ contents
    def populate(self, conversations, current_id: int | None) -> None:
        self._populating = True
        self.list.clear()
        for conv in conversations:
            item = QListWidgetItem(conv.title)
            item.setData(ID_ROLE, conv.id)
            item.setFlags(item.flags() | Qt.ItemFlag.ItemIsEditable)
            item.setToolTip(conv.title)
            self.list.addItem(item)
            if conv.id == current_id:
                self.list.setCurrentItem(item)
        self._populating = False

    def current_id(self) -> int | None:
        item = self.list.currentItem()
        return item.data(ID_ROLE) if item else None

    def ids(self) -> list[int]:
        return [self.list.item(i).data(ID_ROLE) for i in range(self.list.count())]

    def select(self, conversation_id: int) -> None:
        for i in range(self.list.count()):
            if self.list.item(i).data(ID_ROLE) == conversation_id:
                self.list.setCurrentRow(i)
                return

    def set_title(self, conversation_id: int, title: str) -> None:
        self._populating = True
        for i in range(self.list.count()):
            item = self.list.item(i)
            if item.data(ID_ROLE) == conversation_id:
                item.setText(title)
                item.setToolTip(title)
        self._populating = False

    # ------------------------------------------------------------------ actions
    def start_rename(self) -> None:
        item = self.list.currentItem()
        if item is not None:
            self.list.editItem(item)

    def _delete_current(self) -> None:
        conversation_id = self.current_id()
        if conversation_id is not None:
            self.delete_requested.emit(conversation_id)

    def _export(self, fmt: str) -> None:
        conversation_id = self.current_id()
        if conversation_id is not None:
            self.export_requested.emit(conversation_id, fmt)

    def _on_current(self, current, _previous) -> None:
        if current is not None and not self._populating:
            self.selected.emit(current.data(ID_ROLE))

    def _on_item_changed(self, item) -> None:
        if not self._populating:
            self.renamed.emit(item.data(ID_ROLE), item.text())

    def _menu(self, pos) -> None:
        item = self.list.itemAt(pos)
        if item is None:
            return
        self.list.setCurrentItem(item)
        menu = QMenu(self)
        menu.addAction("Rename", self.start_rename)
        menu.addAction("Duplicate", lambda: self.duplicate_requested.emit(item.data(ID_ROLE)))
        menu.addAction("Export as Markdown…", lambda: self._export("md"))
        menu.addAction("Export as JSON…", lambda: self._export("json"))
        menu.addSeparator()
        menu.addAction("Delete", self._delete_current)
        menu.exec(self.list.mapToGlobal(pos))
