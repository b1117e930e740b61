"""Download a model from the Hugging Face hub: a repository id, its choices (the safetensors set or a .gguf file) with
sizes and a "fits your machine" estimate each (engine.fit), then a download with progress (bytes, speed, time
left) and Cancel; when it is done, `downloaded(path)` and the window loads it. Network and disk work runs on its own
thread (app/download.py), never on the GUI thread."""

from __future__ import annotations

import json
import threading

from PySide6.QtCore import QThread, Signal
from PySide6.QtWidgets import (
    QComboBox,
    QDialog,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QListWidget,
    QListWidgetItem,
    QProgressBar,
    QPushButton,
    QVBoxLayout,
)

from .. import download

WEIGHT_FORMATS = (("none", "As published"), ("int8", "INT8"), ("int4", "INT4"))


class _Task(QThread):
    """Run `work(report)` off the GUI thread; `report(obj)` reaches the GUI as `progress`."""

    progress = Signal(object)
    succeeded = Signal(object)
    failed = Signal(str, bool)  # message, cancelled

    def __init__(self, work, parent=None):
        super().__init__(parent)
        self.work = work

    def run(self) -> None:
        try:
            result = self.work(self.progress.emit)
        except download.DownloadCancelled:
            self.failed.emit("Cancelled. The files finished so far are kept; Download again continues from them.",
                             True)
        except download.DownloadError as exc:
            self.failed.emit(str(exc), False)
        except Exception as exc:  # noqa: BLE001 - said, not a crash
            self.failed.emit(f"{type(exc).__name__}: {exc}", False)
        else:
            self.succeeded.emit(result)


class DownloadDialog(QDialog):
    downloaded = Signal(str)  # what to load: a model folder or a .gguf file

    def __init__(self, parent=None, *, context: int = 8192, free_bytes: int = 0, device: str = "cpu",
                 ratio: float = 0.5, cold_tier: bool = True, weight_quant: str = "none", endpoint: str | None = None):
        super().__init__(parent)
        self.setWindowTitle("Download a model from the Hugging Face hub")
        self.setObjectName("downloadDialog")
        self.resize(640, 420)
        self.context, self.free_bytes, self.device = context, free_bytes, device
        self.ratio, self.cold_tier, self.endpoint = ratio, cold_tier, endpoint
        self.files: download.RepoFiles | None = None
        self.model_config: dict | None = None
        self.estimates: dict = {}
        self.cancel_event = threading.Event()
        self.task: _Task | None = None
        self._pending = False
        layout = QVBoxLayout(self)
        row = QHBoxLayout()
        self.repo = QLineEdit()
        self.repo.setPlaceholderText("owner/name, e.g. HuggingFaceTB/SmolLM2-360M-Instruct")
        self.repo.returnPressed.connect(self.find)
        self.find_button = QPushButton("Find files")
        self.find_button.clicked.connect(self.find)
        row.addWidget(self.repo, 1)
        row.addWidget(self.find_button)
        layout.addLayout(row)
        self.choices = QListWidget()
        self.choices.setObjectName("downloadChoices")
        self.choices.currentRowChanged.connect(self._update_buttons)
        layout.addWidget(self.choices, 1)
        fmt = QHBoxLayout()
        fmt.addWidget(QLabel("Weights"))
        self.weights = QComboBox()
        for value, label in WEIGHT_FORMATS:
            self.weights.addItem(label, value)
        self.weights.setCurrentIndex(max(self.weights.findData(weight_quant), 0))
        self.weights.currentIndexChanged.connect(self._show_choices)
        fmt.addWidget(self.weights)
        fmt.addStretch(1)
        fmt.addWidget(QLabel(f"context {context:,} tokens · cache ratio {ratio:.2f}"))
        layout.addLayout(fmt)
        self.progress = QProgressBar()
        self.progress.setRange(0, 1000)
        self.progress.hide()
        layout.addWidget(self.progress)
        self.status = QLabel("Enter a repository id and press Find files.")
        self.status.setWordWrap(True)
        self.status.setObjectName("downloadStatus")
        layout.addWidget(self.status)
        buttons = QHBoxLayout()
        buttons.addStretch(1)
        self.download_button = QPushButton("Download")
        self.download_button.setObjectName("sendButton")
        self.download_button.clicked.connect(self.start_download)
        self.cancel_button = QPushButton("Cancel")
        self.cancel_button.clicked.connect(self.cancel)
        self.close_button = QPushButton("Close")
        self.close_button.clicked.connect(self.reject)
        for button in (self.download_button, self.cancel_button, self.close_button):
            buttons.addWidget(button)
        layout.addLayout(buttons)
        self._update_buttons()

    # ------------------------------------------------------------------ finding
    def find(self) -> None:
        if self.busy:
            return
        repo_id = self.repo.text().strip()
        self.status.setText(f"Looking up {repo_id}…")
        self.choices.clear()
        self.files = self.model_config = None
        self.estimates = {}
        endpoint = self.endpoint
        estimate = self._estimator()

        def work(_report):  # on the task's thread: the network, and engine.fit (its budget rule imports torch)
            files = download.list_files(repo_id, endpoint=endpoint)
            config = None
            if "config.json" in files.sizes:  # a few hundred bytes: the KV and working memory estimate needs it
                from huggingface_hub import hf_hub_download

                path = hf_hub_download(files.repo_id, "config.json", local_dir=download.target_folder(files.repo_id),
                                       endpoint=download.hub_endpoint(endpoint))
                with open(path, encoding="utf-8") as f:
                    config = json.load(f)
            estimates = {(i, fmt): estimate(config or {}, choice, fmt)
                         for i, choice in enumerate(files.choices) for fmt, _ in WEIGHT_FORMATS}
            return files, config, estimates

        self._run(work, self._found)

    def _estimator(self):
        context, free, device, ratio, cold = self.context, self.free_bytes, self.device, self.ratio, self.cold_tier

        def estimate(config: dict, choice: download.Choice, weight_quant: str):
            from engine import fit

            return fit.estimate(config, choice.weights_size, kind=choice.kind, context=context, free=free,
                                device=device, weight_quant=weight_quant, ratio=ratio, file_name=choice.files[0],
                                cold_tier=cold)

        return estimate

    def _found(self, result) -> None:
        self.files, self.model_config, self.estimates = result
        if not self.files.choices:
            self.status.setText(f"{self.files.repo_id} has no safetensors weights or .gguf files this app can load.")
        else:
            self.status.setText("Pick what to download. The estimate is weights + KV cache at this context + working "
                                "memory, against the free memory now.")
        self._show_choices()
        if self.files.choices:
            self.choices.setCurrentRow(0)

    def estimate(self, index: int):
        """The fit estimate (engine.fit.FitEstimate) of choice `index` at the weights format shown."""
        return self.estimates[(index, self.weights.currentData())]

    def _show_choices(self) -> None:
        row = self.choices.currentRow()
        self.choices.clear()
        for index, choice in enumerate(self.files.choices if self.files else ()):
            guess = self.estimate(index)
            kv_note = "" if self.model_config else " (KV not counted: no config.json)"
            item = QListWidgetItem(f"{choice.label} · {choice.size / 1e6:,.0f} MB\n    {guess.describe()}{kv_note}")
            item.setToolTip("\n".join(choice.files))
            self.choices.addItem(item)
        if row >= 0:
            self.choices.setCurrentRow(min(row, self.choices.count() - 1))

    # ------------------------------------------------------------------ downloading
    @property
    def busy(self) -> bool:
        """A task runs, or its result has not reached the dialog yet (its signals are queued to this thread)."""
        return self._pending

    def selected(self) -> download.Choice | None:
        row = self.choices.currentRow()
        return self.files.choices[row] if self.files and 0 <= row < len(self.files.choices) else None

    def start_download(self) -> None:
        choice = self.selected()
        if choice is None or self.busy:
            return
        self.cancel_event = threading.Event()
        cancel, endpoint, repo_id = self.cancel_event, self.endpoint, self.files.repo_id
        self.progress.setValue(0)
        self.progress.show()
        self.status.setText(f"Downloading {choice.label} into {download.target_folder(repo_id)}…")

        def work(report):
            return download.download(repo_id, choice, progress=report, cancel=cancel, endpoint=endpoint)

        self._run(work, self._downloaded, progress=self._on_progress)

    def _on_progress(self, p: download.Progress) -> None:
        self.progress.setValue(int(1000 * p.done / p.total) if p.total else 0)
        self.progress.setFormat(f"{100 * p.done / p.total:.0f} %" if p.total else "")
        self.status.setText(f"{p.describe()} — {p.file}")

    def _downloaded(self, path) -> None:
        self.progress.setValue(1000)
        self.status.setText(f"Downloaded to {path}. Loading it…")
        self.downloaded.emit(str(path))
        self.accept()

    def cancel(self) -> None:
        if self.busy:
            self.cancel_event.set()
            self.status.setText("Cancelling…")
        else:
            self.reject()

    # ------------------------------------------------------------------ plumbing
    def _run(self, work, on_success, progress=None) -> None:
        self.task = _Task(work, self)
        if progress is not None:
            self.task.progress.connect(progress)
        self.task.succeeded.connect(on_success)
        self.task.failed.connect(self._failed)
        self.task.finished.connect(self._task_finished)  # delivered after its result
        self._pending = True
        self.task.start()
        self._update_buttons()

    def _task_finished(self) -> None:
        self._pending = False
        self._update_buttons()

    def _failed(self, message: str, cancelled: bool) -> None:
        self.status.setText(("" if cancelled else "⚠ ") + message)

    def _update_buttons(self, *_args) -> None:
        busy = self.busy
        self.find_button.setEnabled(not busy)
        self.download_button.setEnabled(not busy and self.selected() is not None)
        self.cancel_button.setText("Cancel download" if busy else "Cancel")
        self.close_button.setEnabled(not busy)

    def reject(self) -> None:
        if self.task is not None and self.task.isRunning():  # closing cancels the download and waits for it
            self.cancel_event.set()
            self.task.wait(10_000)
        super().reject()
