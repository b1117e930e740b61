"""Which model to run: default / a folder / a .gguf file / a hub id; weights; device; context; load progress."""

from __future__ import annotations

from PySide6.QtCore import Qt, Signal
from PySide6.QtGui import QPainter
from PySide6.QtWidgets import (
    QComboBox,
    QFileDialog,
    QHBoxLayout,
    QLabel,
    QMenu,
    QProgressBar,
    QPushButton,
    QSizePolicy,
    QSpinBox,
    QVBoxLayout,
    QWidget,
)

WEIGHTS = (("none", "Full precision"), ("int8", "INT8"), ("int4", "INT4"))
DEVICES = (("auto", "Auto"), ("cpu", "CPU"), ("cuda", "GPU (CUDA)"))
DEFAULT_SOURCE = "default"


class ElidedLabel(QLabel):
    """A one-line label that ends in '…' when it is narrower than its text (the tooltip has it all)."""

    def paintEvent(self, _event) -> None:  # noqa: N802 - Qt override
        painter = QPainter(self)
        text = self.fontMetrics().elidedText(self.text(), Qt.TextElideMode.ElideRight, self.contentsRect().width())
        painter.setPen(self.palette().color(self.foregroundRole()))
        painter.drawText(self.contentsRect(), int(Qt.AlignmentFlag.AlignLeft | Qt.AlignmentFlag.AlignVCenter), text)


class ModelPanel(QWidget):
    load_requested = Signal(dict)  # DSV41Config fields that need a (re)load
    download_requested = Signal()  # the user wants a model from the hub (the window opens the dialog)

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.setObjectName("modelPanel")
        # two rows: the controls, then the loading progress and the status (a whole line of its own: readable at
        # every window width down to 1024 px)
        rows = QVBoxLayout(self)
        rows.setContentsMargins(8, 4, 8, 2)
        rows.setSpacing(2)
        row = QHBoxLayout()
        row.setSpacing(6)
        rows.addLayout(row)
        row.addWidget(QLabel("Model"))
        self.source = QComboBox()
        self.source.setEditable(True)
        self.source.setMinimumWidth(160)
        self.source.setSizeAdjustPolicy(QComboBox.SizeAdjustPolicy.AdjustToMinimumContentsLengthWithIcon)
        self.source.setMinimumContentsLength(14)
        self.source.addItem(DEFAULT_SOURCE)
        self.source.setToolTip("'default' (SmolLM2-135M-Instruct, bundled), a model folder, a .gguf file, "
                               "or a Hugging Face hub id such as HuggingFaceTB/SmolLM2-360M-Instruct")
        self.source.lineEdit().setPlaceholderText("default, a folder, a .gguf file or a hub id")
        row.addWidget(self.source, 2)
        self.open_button = QPushButton("Open")
        self.open_button.setToolTip("A model folder, a .gguf file, or a download from the Hugging Face hub")
        menu = QMenu(self.open_button)
        menu.addAction("Model folder…", self._pick_folder)
        menu.addAction(".gguf file…", self._pick_gguf)
        menu.addSeparator()
        self.download_action = menu.addAction("Download from the Hugging Face hub…", self.download_requested.emit)
        self.open_button.setMenu(menu)
        row.addWidget(self.open_button)
        row.addWidget(QLabel("Weights"))
        self.weights = QComboBox()
        for value, label in WEIGHTS:
            self.weights.addItem(label, value)
        self.weights.setSizeAdjustPolicy(QComboBox.SizeAdjustPolicy.AdjustToMinimumContentsLengthWithIcon)
        self.weights.setMinimumContentsLength(11)
        row.addWidget(self.weights)
        row.addWidget(QLabel("Device"))
        self.device = QComboBox()
        for value, label in DEVICES:
            self.device.addItem(label, value)
        row.addWidget(self.device)
        row.addWidget(QLabel("Context"))
        self.max_seq_len = QSpinBox()
        self.max_seq_len.setRange(256, 1 << 20)
        self.max_seq_len.setSingleStep(1024)
        self.max_seq_len.setValue(8192)
        self.max_seq_len.setSuffix(" tok")
        self.max_seq_len.setToolTip("max_seq_len: the most tokens a conversation may hold (capped by the model)")
        row.addWidget(self.max_seq_len)
        self.load_button = QPushButton("Load")
        self.load_button.setObjectName("loadButton")
        self.load_button.clicked.connect(self.request_load)
        row.addWidget(self.load_button)
        row.addStretch(0)
        status_row = QHBoxLayout()
        status_row.setSpacing(6)
        rows.addLayout(status_row)
        self.progress = QProgressBar()
        self.progress.setRange(0, 100)
        self.progress.setMaximumWidth(160)
        self.progress.setTextVisible(True)
        self.progress.hide()
        status_row.addWidget(self.progress)
        self.status = ElidedLabel("No model")
        self.status.setObjectName("modelStatus")
        # Long names and messages must not widen the window; the full text is in the tooltip.
        self.status.setSizePolicy(QSizePolicy.Policy.Ignored, QSizePolicy.Policy.Preferred)
        self.status.setMinimumWidth(120)
        status_row.addWidget(self.status, 1)

    # ------------------------------------------------------------------ values
    def options(self) -> dict:
        return {"model_path": self.source.currentText().strip() or DEFAULT_SOURCE,
                "weight_quant": self.weights.currentData(), "device_map": self.device.currentData(),
                "max_seq_len": self.max_seq_len.value()}

    def set_options(self, options: dict) -> None:
        source = options.get("model_path") or DEFAULT_SOURCE
        if self.source.findText(source) < 0:
            self.source.addItem(source)
        self.source.setCurrentText(source)
        self.weights.setCurrentIndex(max(self.weights.findData(options.get("weight_quant", "none")), 0))
        self.device.setCurrentIndex(max(self.device.findData(options.get("device_map", "auto")), 0))
        if isinstance(options.get("max_seq_len"), int):
            self.max_seq_len.setValue(options["max_seq_len"])

    def request_load(self) -> None:
        self.load_requested.emit(self.options())

    # ------------------------------------------------------------------ state
    def show_loading(self, message: str, fraction: float) -> None:
        self.progress.show()
        self.progress.setValue(int(round(100 * max(0.0, min(fraction, 1.0)))))
        self.status.setText(message)
        self.load_button.setEnabled(False)

    def show_loaded(self, facts) -> None:
        self.progress.hide()
        self.load_button.setEnabled(True)
        weights = facts.weight_quant if facts.weight_quant != "none" or not facts.weight_storage else \
            f"held as {facts.weight_storage}"
        if getattr(facts, "prefill_bf16", False):
            weights += ", prefill in bf16"
        text = (f"{facts.display_name} · {facts.device} · {facts.dtype} · weights {weights}"
                f" · {facts.attention_backend} · {facts.context_limit:,} tokens")
        self.status.setText(text)
        kernels = getattr(facts, "attention_kernels", "")
        self.status.setToolTip(f"{text}\n" + (f"Attention kernels: {kernels}\n" if kernels else "")
                               + f"Loaded in {facts.load_seconds:.1f} s from {facts.source}")

    def show_kept(self, message: str, facts) -> None:
        """A load failed and the model that was working stays: say both."""
        self.status.setText(f"{facts.display_name} still loaded — the new model failed: {message.split('. ')[0][:70]}")
        self.status.setToolTip(message)

    def show_failed(self, message: str) -> None:
        self.progress.hide()
        self.load_button.setEnabled(True)
        self.status.setText("Load failed — " + message.split(". ")[0][:90])
        self.status.setToolTip(message)

    # ------------------------------------------------------------------ pickers
    def _pick_folder(self) -> None:
        folder = QFileDialog.getExistingDirectory(self, "Pick a model folder (config.json + .safetensors)")
        if folder:
            self.source.setCurrentText(folder)

    def _pick_gguf(self) -> None:
        path, _ = QFileDialog.getOpenFileName(self, "Pick a GGUF model file", "", "GGUF models (*.gguf)")
        if path:
            self.source.setCurrentText(path)
