"""Attaching documents: parse (and list a dropped folder's) on a thread pool, never the GUI thread, then judge
whether they fit.

Parsing goes through engine.documents.load_document, which is pure Python; it runs on
QThreadPool threads and reports back by queued signals.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from PySide6.QtCore import QObject, QRunnable, QThreadPool, Signal

from engine.documents import DocumentError

from .knobs import SLIDER
from .protocol import AttachedDocument

_keys = itertools.count(1)
_RATIO = SLIDER["kv_cache_ratio"]


class _ParseSignals(QObject):
    parsed = Signal(str, object)  # request key, AttachedDocument
    failed = Signal(str, str, str)  # request key, path, message
    listed = Signal(str, object)  # request key, engine.documents.folder.FolderDocuments


class _Job(QRunnable):
    """One file read as a document, or one folder's documents listed (a network share can take seconds to walk)."""

    def __init__(self, key: str, path: str, signals: _ParseSignals, *, folder: bool = False):
        super().__init__()
        self.key, self.path, self.signals, self.folder = key, path, signals, folder

    def run(self) -> None:
        try:
            if self.folder:
                from engine.documents.folder import folder_documents

                found = folder_documents(self.path)
            else:
                from engine.documents import load_document

                doc = load_document(self.path)
        except Exception as exc:  # noqa: BLE001 - DocumentError carries the user's message; others too
            message = str(exc) if isinstance(exc, DocumentError) else f"{self.path}: {type(exc).__name__}: {exc}"
            self.signals.failed.emit(self.key, self.path, message)
            return
        if self.folder:
            self.signals.listed.emit(self.key, found)
        else:
            self.signals.parsed.emit(self.key, AttachedDocument(self.key, doc.name, doc.path, doc.kind, doc.text,
                                                                doc.pages, doc.chars, tuple(doc.notes)))


class DocumentLoader(QObject):
    """Parses files off the GUI thread. `load(path)` returns the key its result will carry."""

    parsed = Signal(str, object)
    failed = Signal(str, str, str)
    listed = Signal(str, object)  # a folder's key (list_folder), its FolderDocuments

    def __init__(self, parent: QObject | None = None):
        super().__init__(parent)
        self.pool = QThreadPool(self)
        self.pool.setMaxThreadCount(2)
        self._signals = _ParseSignals(self)
        self._signals.parsed.connect(self._on_parsed)
        self._signals.failed.connect(self._on_failed)
        self._signals.listed.connect(self._on_listed)
        self.pending: set[str] = set()

    def load(self, path: str) -> str:
        key = f"doc-{next(_keys)}"
        self.pending.add(key)
        self.pool.start(_Job(key, path, self._signals))
        return key

    def list_folder(self, path: str) -> str:
        """List the documents inside the folder `path` on the pool; the key its `listed` (or `failed`) carries."""
        key = f"folder-{next(_keys)}"
        self.pending.add(key)
        self.pool.start(_Job(key, path, self._signals, folder=True))
        return key

    def _on_listed(self, key: str, found) -> None:
        self.pending.discard(key)
        self.listed.emit(key, found)

    def _on_parsed(self, key: str, doc: AttachedDocument) -> None:
        self.pending.discard(key)
        self.parsed.emit(key, doc)

    def _on_failed(self, key: str, path: str, message: str) -> None:
        self.pending.discard(key)
        self.failed.emit(key, path, message)

    def wait(self, timeout_ms: int = 30_000) -> bool:
        return self.pool.waitForDone(timeout_ms)


@dataclass(frozen=True)
class FitAssessment:
    kv_bytes: int | None  # this document's share of the cache after compaction (the engine's figure), if known
    fits: bool
    warning: str | None  # says which knob would make it fit


MIN_SUGGESTED_RATIO = 0.1  # below this the advice is INT8 or a smaller document: answers worsen too much


def assess_fit(tokens: int, *, tokens_before: int, context_limit: int, max_positions: int, kv_bytes: int | None,
               kv_after: int | None, bytes_per_token: int, free_bytes: int | None, prefill_headroom,
               kv_dtype: str) -> FitAssessment:
    """Judge one document that comes after `tokens_before` tokens (system, history, earlier documents).

    `kv_bytes` (its share) and `kv_after` (the whole cache once it holds it) are the engine's figures
    (DSV41Model.stored_kv_bytes, budget floor included), None until the worker has sent them; the context check
    needs only the tokens."""
    needed = tokens_before + tokens
    if needed >= context_limit:
        if max_positions and needed < max_positions:
            knob = (f"Raise max_seq_len in the model panel to at least {_round_up(needed + 512)} "
                    f"(the model reads up to {max_positions:,}) and reload")
        else:
            knob = f"Attach an excerpt: the model reads at most {max(max_positions, context_limit):,} tokens"
        return FitAssessment(kv_bytes, False, f"Will not fit the context: needs ~{needed:,} of {context_limit:,} "
                                              f"tokens. {knob}, or start a new chat.")
    if free_bytes:
        if kv_after is not None and kv_after > 0.9 * free_bytes:
            # The ratio whose budget would fit (a large document is far above the budget's floor).
            target = 0.9 * free_bytes / max(needed * bytes_per_token, 1)
            step = _RATIO.step
            if target >= MIN_SUGGESTED_RATIO:
                knob = f"lower Cache ratio to {math.floor(target / step) * step:.{_RATIO.decimals}f}"
            elif kv_dtype != "int8":
                knob = "set KV dtype to INT8 and lower Cache ratio"
            else:
                knob = "pick a smaller document or free memory"
            return FitAssessment(kv_bytes, False, f"Will not fit in free memory at the current settings: {knob}.")
        if isinstance(prefill_headroom, int) and min(tokens, prefill_headroom) * bytes_per_token > 0.9 * free_bytes:
            return FitAssessment(kv_bytes, False, "The prefill headroom would not fit in free memory: "
                                                  "lower Prefill headroom (or set it to Auto).")
    return FitAssessment(kv_bytes, True, None)


def _round_up(n: int, step: int = 1024) -> int:
    return int(math.ceil(n / step) * step)
