"""Which model to run: default / a folder / a .gguf file / a hub id / an OpenAI-compatible server; weights; device;
context; load progress; and Serve (the loaded model as an OpenAI-compatible API for other programs)."""

from __future__ import annotations

from PySide6.QtCore import Qt, Signal
from PySide6.QtGui import QPainter
from PySide6.QtWidgets import (
    QComboBox,
    QDialog,
    QDialogButtonBox,
    QFileDialog,
    QFormLayout,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QMenu,
    QProgressBar,
    QPushButton,
    QSizePolicy,
    QSpinBox,
    QVBoxLayout,
    QWidget,
)

from engine.remote import is_remote

WEIGHTS = (("none", "Full precision"), ("int8", "INT8"), ("int4", "INT4"))
DEVICES = (("auto", "Auto"), ("cpu", "CPU"), ("cuda", "GPU (CUDA)"))
DEFAULT_SOURCE = "default"
DEFAULT_SERVER = "http://127.0.0.1:8000/v1"
DEFAULT_SERVE_PORT = 8000


class ElidedLabel(QLabel):
    """A one-line label that ends in '…' when it is narrower than its text (the tooltip has it all)."""

    def paintEvent(self, _event) -> None:  # noqa: N802 - Qt override
        painter = QPainter(self)
        text = self.fontMetrics().elidedText(self.text(), Qt.TextElideMode.ElideRight, self.contentsRect().width())
        painter.setPen(self.palette().color(self.foregroundRole()))
        painter.drawText(self.contentsRect(), int(Qt.AlignmentFlag.AlignLeft | Qt.AlignmentFlag.AlignVCenter), text)


class RemoteDialog(QDialog):
    """The address of an OpenAI-compatible server (ours, vLLM, SGLang, LM Studio, Ollama…) and its API key."""

    def __init__(self, parent: QWidget | None = None, url: str = "", api_key: str = ""):
        super().__init__(parent)
        self.setWindowTitle("OpenAI-compatible server")
        form = QFormLayout(self)
        note = QLabel("Chat with a model another program serves: python -m engine serve (all the cache knobs), "
                      "or vLLM, SGLang, LM Studio, Ollama, llama.cpp's server (the reply only: the knobs are ours "
                      "and their memory is not reported).")
        note.setWordWrap(True)
        form.addRow(note)
        self.url = QLineEdit(url or DEFAULT_SERVER)
        self.url.setPlaceholderText(DEFAULT_SERVER)
        self.key = QLineEdit(api_key)
        self.key.setEchoMode(QLineEdit.EchoMode.Password)
        self.key.setPlaceholderText("none")
        self.key.setToolTip("Sent as Authorization: Bearer <key>; kept in the app's settings file")
        form.addRow("Address", self.url)
        form.addRow("API key", self.key)
        buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Ok | QDialogButtonBox.StandardButton.Cancel)
        buttons.button(QDialogButtonBox.StandardButton.Ok).setText("Connect")
        buttons.accepted.connect(self.accept)
        buttons.rejected.connect(self.reject)
        form.addRow(buttons)
        self.resize(460, self.sizeHint().height())

    def values(self) -> tuple[str, str]:
        url = self.url.text().strip() or DEFAULT_SERVER
        if not is_remote(url):
            url = "http://" + url
        return url, self.key.text().strip()


class ModelPanel(QWidget):
    load_requested = Signal(dict)  # DSV41Config fields that need a (re)load
    download_requested = Signal()  # the user wants a model from the hub (the window opens the dialog)
    serve_requested = Signal(dict)  # {"host", "port"}: serve the loaded model
    serve_stop_requested = Signal()

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
        menu.addSeparator()
        self.remote_action = menu.addAction("OpenAI-compatible server…", self.pick_server)
        self.api_key = ""  # the server's, when the source is a server address
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
        self.serve_address = QLabel("")
        self.serve_address.setObjectName("dimLabel")
        self.serve_address.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        status_row.addWidget(self.serve_address)
        self.serve_port = QSpinBox()
        self.serve_port.setRange(1024, 65535)
        self.serve_port.setValue(DEFAULT_SERVE_PORT)
        self.serve_port.setPrefix("port ")
        self.serve_port.setToolTip("The port Serve listens on (127.0.0.1 only: this machine's programs)")
        status_row.addWidget(self.serve_port)
        self.serve_button = QPushButton("Serve")
        self.serve_button.setObjectName("serveButton")
        self.serve_button.setCheckable(True)
        self.serve_button.setEnabled(False)
        self.serve_button.setToolTip("Serve the loaded model as an OpenAI-compatible API (POST /v1/chat/completions) "
                                     "for editors, notebooks and scripts on this machine")
        self.serve_button.toggled.connect(self._serve_toggled)
        status_row.addWidget(self.serve_button)
        self.source.currentTextChanged.connect(self._source_changed)

    # ------------------------------------------------------------------ values
    def options(self) -> dict:
        options = {"model_path": self.source.currentText().strip() or DEFAULT_SOURCE,
                   "weight_quant": self.weights.currentData(), "device_map": self.device.currentData(),
                   "max_seq_len": self.max_seq_len.value()}
        if is_remote(options["model_path"]) and self.api_key:
            options["api_key"] = self.api_key
        return options

    def set_options(self, options: dict) -> None:
        source = options.get("model_path") or DEFAULT_SOURCE
        if self.source.findText(source) < 0:
            self.source.addItem(source)
        self.source.setCurrentText(source)
        self.weights.setCurrentIndex(max(self.weights.findData(options.get("weight_quant", "none")), 0))
        self.device.setCurrentIndex(max(self.device.findData(options.get("device_map", "auto")), 0))
        if isinstance(options.get("max_seq_len"), int):
            self.max_seq_len.setValue(options["max_seq_len"])
        self.api_key = options.get("api_key") if isinstance(options.get("api_key"), str) else ""
        self._source_changed(source)

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
        remote = facts.remote
        self.serve_button.setEnabled(not remote)
        self.serve_button.setToolTip(
            "A model of another server is not served again from here: point other programs at that server"
            if remote else "Serve the loaded model as an OpenAI-compatible API (POST /v1/chat/completions) for "
            "editors, notebooks and scripts on this machine")
        if remote:
            kind = (f"DS-V4.1 server on {facts.device.removeprefix('remote ')} · {facts.dtype} · "
                    f"{facts.attention_backend}" if remote == "dsv41"
                    else "OpenAI-compatible server (no cache knobs, memory not reported)")
            text = f"{facts.display_name} · {kind} · {facts.context_limit:,} tokens"
            self.status.setText(text)
            self.status.setToolTip(f"{text}\nConnected in {facts.load_seconds:.1f} s to {facts.source}")
            return
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

    # ------------------------------------------------------------------ a server as the model; Serve
    def pick_server(self) -> RemoteDialog:
        """Ask for a server's address and key; Connect loads it as the model."""
        current = self.source.currentText().strip()
        dialog = RemoteDialog(self, current if is_remote(current) else "", self.api_key)

        def connect():
            url, key = dialog.values()
            self.api_key = key
            if self.source.findText(url) < 0:
                self.source.addItem(url)
            self.source.setCurrentText(url)
            self.request_load()

        dialog.accepted.connect(connect)
        self.remote_dialog = dialog
        dialog.open()
        return dialog

    def _source_changed(self, text: str) -> None:
        """Weights and device are the server's business when the source is a server."""
        remote = is_remote(text)
        for widget in (self.weights, self.device):
            widget.setEnabled(not remote)
            widget.setToolTip("Set on the server" if remote else "")
        self.max_seq_len.setToolTip("The server's limit is used where it reports one (vLLM and ours do); otherwise "
                                    "this" if remote else "max_seq_len: the most tokens a conversation may hold "
                                    "(capped by the model)")

    def _serve_toggled(self, on: bool) -> None:
        if on:
            self.serve_requested.emit({"host": "127.0.0.1", "port": self.serve_port.value()})
        else:
            self.serve_stop_requested.emit()

    def show_serving(self, address: str) -> None:
        """The worker's answer: serving at `address`, or stopped ('')."""
        self.serve_button.blockSignals(True)
        self.serve_button.setChecked(bool(address))
        self.serve_button.setText("Stop serving" if address else "Serve")
        self.serve_button.blockSignals(False)
        self.serve_port.setEnabled(not address)
        self.serve_address.setText(f"serving {address}" if address else "")
        self.serve_address.setToolTip(f"Other programs on this machine: base_url={address} (OpenAI clients)"
                                      if address else "")

    # ------------------------------------------------------------------ pickers
    def _pick_folder(self) -> None:
        folder = QFileDialog.getExistingDirectory(self, "Pick a model folder (config.json + .safetensors)")
        if folder:
            self.source.setCurrentText(folder)

    def _pick_gguf(self) -> None:
        path, _ = QFileDialog.getOpenFileName(self, "Pick a GGUF model file", "", "GGUF models (*.gguf);;All files (*)")
        if path:
            self.source.setCurrentText(path)
