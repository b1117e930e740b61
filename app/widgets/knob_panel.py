"""Compression knobs (sliders with their values), presets, and the generation options."""

from __future__ import annotations

from PySide6.QtCore import Qt, QTimer, Signal
from PySide6.QtWidgets import (
    QCheckBox,
    QComboBox,
    QDoubleSpinBox,
    QFormLayout,
    QGridLayout,
    QGroupBox,
    QHBoxLayout,
    QLabel,
    QPushButton,
    QSlider,
    QSpinBox,
    QVBoxLayout,
    QWidget,
)

from .. import knobs as K
from ..format import fmt_bytes
from ..protocol import GenerationOptions

DEBOUNCE_MS = 300


class KnobPanel(QGroupBox):
    knobs_changed = Signal(dict)  # debounced; the window sends it to the engine (pending during a reply)
    generation_changed = Signal(object)  # GenerationOptions: a reply option was edited

    def __init__(self, parent: QWidget | None = None):
        super().__init__("Compression", parent)
        self.setObjectName("knobPanel")
        layout = QVBoxLayout(self)
        layout.setSpacing(4)
        presets = QGridLayout()
        presets.setSpacing(4)
        self.preset_buttons: dict[str, QPushButton] = {}
        for i, name in enumerate(K.PRESETS):
            button = QPushButton(name)
            button.setObjectName("presetButton")
            button.setToolTip(", ".join(f"{k}={v}" for k, v in K.PRESETS[name].items()))
            button.clicked.connect(lambda _c=False, n=name: self.apply_preset(n))
            presets.addWidget(button, i // 2, i % 2)
            self.preset_buttons[name] = button
        layout.addLayout(presets)

        grid = QGridLayout()
        grid.setHorizontalSpacing(6)
        grid.setVerticalSpacing(2)
        self.sliders: dict[str, QSlider] = {}
        self.value_labels: dict[str, QLabel] = {}
        for row, spec in enumerate(K.SLIDERS):
            name_label = QLabel(spec.label)
            name_label.setToolTip(spec.tip)
            slider = QSlider(Qt.Orientation.Horizontal)
            slider.setRange(0, spec.ticks)
            slider.setToolTip(spec.tip)
            slider.setObjectName(f"knob_{spec.name}")
            value = QLabel("")
            value.setMinimumWidth(44)
            value.setAlignment(Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter)
            slider.valueChanged.connect(lambda _v, s=spec: self._on_slider(s))
            grid.addWidget(name_label, row, 0)
            grid.addWidget(slider, row, 1)
            grid.addWidget(value, row, 2)
            self.sliders[spec.name] = slider
            self.value_labels[spec.name] = value
        grid.setColumnStretch(1, 1)
        layout.addLayout(grid)

        form = QFormLayout()
        form.setSpacing(3)
        self.mode = QComboBox()
        for value, label in K.CED_MODES:
            self.mode.addItem(label, value)
        self.kv_dtype = QComboBox()
        for value, label in K.KV_DTYPES:
            self.kv_dtype.addItem(label, value)
        self.cold_tier = QComboBox()
        for value, label in K.COLD_TIERS:
            self.cold_tier.addItem(label, value)
        self.cold_tier.setToolTip(K.COLD_TIER_TIP)
        self.headroom = QComboBox()
        for value in K.HEADROOM_STEPS:
            self.headroom.addItem(K.headroom_label(value), value)
        self.headroom.setToolTip("How much of a document may be read before the cache compacts while it streams in; "
                                 "compaction after the question is read keeps what the question needs.")
        self.mode.setToolTip(K.CED_MODE_TIP)
        self.kv_dtype.setToolTip(K.KV_DTYPE_TIP)
        for combo in (self.mode, self.kv_dtype, self.cold_tier, self.headroom):
            combo.setSizeAdjustPolicy(QComboBox.SizeAdjustPolicy.AdjustToMinimumContentsLengthWithIcon)
            combo.setMinimumContentsLength(8)
            combo.currentIndexChanged.connect(self._changed)
        form.addRow(K.CED_MODE_LABEL, self.mode)
        form.addRow(K.KV_DTYPE_LABEL, self.kv_dtype)
        form.addRow(K.COLD_TIER_LABEL, self.cold_tier)
        form.addRow(K.HEADROOM_LABEL, self.headroom)
        layout.addLayout(form)

        self.status = QLabel("")
        self.status.setObjectName("knobStatus")
        self.status.setWordWrap(True)
        layout.addWidget(self.status)

        gen = QGroupBox("Reply")
        gen.setObjectName("replyOptions")
        gen_form = QFormLayout(gen)
        gen_form.setSpacing(3)
        defaults = GenerationOptions()
        self.max_tokens = QSpinBox()
        self.max_tokens.setRange(1, 8192)
        self.temperature = QDoubleSpinBox()
        self.temperature.setRange(0.0, 2.0)
        self.temperature.setSingleStep(0.05)
        self.greedy = QCheckBox("Greedy")
        self.greedy.setToolTip("Always pick the most likely token: the same question gives the same answer "
                               "(temperature, top-p, top-k and seed are then not used)")
        row = QHBoxLayout()
        row.addWidget(self.temperature)
        row.addWidget(self.greedy)
        # the ranges are the engine's (engine.config.GenerationSettings), so no value the engine refuses can be set
        self.top_p = QDoubleSpinBox()
        self.top_p.setRange(0.01, 1.0)
        self.top_p.setSingleStep(0.05)
        self.top_p.setToolTip("Sample from the smallest set of tokens whose probabilities add up to this (1 = off)")
        self.top_k = QSpinBox()
        self.top_k.setRange(0, 1000)
        self.top_k.setSpecialValueText("off")
        self.top_k.setToolTip("Sample from the k most likely tokens only (0 = off)")
        self.repetition_penalty = QDoubleSpinBox()
        self.repetition_penalty.setRange(1.0, 3.0)
        self.repetition_penalty.setSingleStep(0.05)
        self.repetition_penalty.setToolTip("Make tokens of the last 256 less likely to come again (1 = off)")
        self.seed = QSpinBox()
        self.seed.setRange(-1, 2**31 - 1)
        self.seed.setSpecialValueText("random")
        self.seed.setToolTip("A fixed seed makes a sampled reply repeatable (random: a new draw every time)")
        gen_form.addRow("Max new tokens", self.max_tokens)
        gen_form.addRow("Temperature", row)
        gen_form.addRow("Top-p", self.top_p)
        gen_form.addRow("Top-k", self.top_k)
        gen_form.addRow("Repetition penalty", self.repetition_penalty)
        gen_form.addRow("Seed", self.seed)
        layout.addWidget(gen)
        self._generation_quiet = False  # True while set_generation puts values in (no generation_changed then)
        self.set_generation(defaults)
        for box in (self.max_tokens, self.temperature, self.top_p, self.top_k, self.repetition_penalty, self.seed):
            box.valueChanged.connect(self._generation_edited)
        self.greedy.toggled.connect(self._generation_edited)

        self._debounce = QTimer(self, singleShot=True, interval=DEBOUNCE_MS)
        self._debounce.timeout.connect(lambda: self.knobs_changed.emit(self.values()))
        self._quiet = False
        self.set_values(K.DEFAULTS)

    # ------------------------------------------------------------------ values
    def values(self) -> dict:
        out = {spec.name: spec.from_tick(self.sliders[spec.name].value()) for spec in K.SLIDERS}
        out["ced_mode"] = self.mode.currentData()
        out["kv_cache_dtype"] = self.kv_dtype.currentData()
        out["cold_tier"] = self.cold_tier.currentData()
        out["prefill_headroom"] = self.headroom.currentData()
        return out

    def set_values(self, values: dict, *, notify: bool = False) -> None:
        values = K.sanitize({**self.values(), **values} if self.sliders and self.mode.count() else values)
        self._quiet = True
        for spec in K.SLIDERS:
            self.sliders[spec.name].setValue(spec.to_tick(values[spec.name]))
            self._show_value(spec)
        self.mode.setCurrentIndex(max(self.mode.findData(values["ced_mode"]), 0))
        self.kv_dtype.setCurrentIndex(max(self.kv_dtype.findData(values["kv_cache_dtype"]), 0))
        self.cold_tier.setCurrentIndex(max(self.cold_tier.findData(values["cold_tier"]), 0))
        self.headroom.setCurrentIndex(max(self.headroom.findData(values["prefill_headroom"]), 0))
        self._quiet = False
        if notify:
            self._changed()

    def flush(self) -> None:
        """A change still waiting for its debounce, emitted now (the chat it was made in is being left)."""
        if self._debounce.isActive():
            self._debounce.stop()
            self.knobs_changed.emit(self.values())

    def cancel_pending(self) -> None:
        """Drop a change still waiting for its debounce (the window is closing)."""
        self._debounce.stop()

    def apply_preset(self, name: str) -> None:
        self.set_values(K.PRESETS[name], notify=True)
        self.status.setText(f"Preset “{name}”")

    def generation(self) -> GenerationOptions:
        seed = self.seed.value()
        return GenerationOptions(max_new_tokens=self.max_tokens.value(), temperature=round(self.temperature.value(), 2),
                                 greedy=self.greedy.isChecked(), seed=None if seed < 0 else seed,
                                 top_p=round(self.top_p.value(), 2), top_k=self.top_k.value(),
                                 repetition_penalty=round(self.repetition_penalty.value(), 2))

    def set_generation(self, options: GenerationOptions) -> None:
        self._generation_quiet = True
        try:
            self.max_tokens.setValue(options.max_new_tokens)
            self.temperature.setValue(options.temperature)
            self.greedy.setChecked(options.greedy)
            self.top_p.setValue(options.top_p)
            self.top_k.setValue(options.top_k)
            self.repetition_penalty.setValue(options.repetition_penalty)
            self.seed.setValue(-1 if options.seed is None or options.seed > self.seed.maximum() else options.seed)
        finally:
            self._generation_quiet = False
        self._sampling_enabled()

    def _generation_edited(self, *_args) -> None:
        self._sampling_enabled()
        if not self._generation_quiet:
            self.generation_changed.emit(self.generation())

    def _sampling_enabled(self) -> None:
        sampled = not self.greedy.isChecked()
        for box in (self.temperature, self.top_p, self.top_k, self.seed):
            box.setEnabled(sampled)

    def set_remote(self, remote: str) -> None:
        """The cache controls work on this process's engine and on our server ("dsv41": sent with every request);
        another server has none of them ("openai"), so they are disabled with the reason. Reply options stay."""
        tunable = remote != "openai"
        controls = [*self.preset_buttons.values(), *self.sliders.values(), self.mode, self.kv_dtype, self.cold_tier,
                    self.headroom]
        for widget in controls:
            widget.setEnabled(tunable)
        reason = ("The server is not DS-V4.1: its cache has none of these knobs (connect to python -m engine serve "
                  "to tune them over the network)")
        self.setToolTip("" if tunable else reason)
        if not tunable:
            self.status.setText("⚠ " + reason)
            self.status.setProperty("state", "error")
            self._restyle()
        elif self.status.text().startswith("⚠ The server is not DS-V4.1"):
            self.status.setText("")
            self.status.setProperty("state", "")
            self._restyle()

    # ------------------------------------------------------------------ feedback
    def show_pending(self, knobs: dict) -> None:
        self.status.setText("… Pending — applies after this reply: " + _describe(knobs))
        self.status.setProperty("state", "pending")
        self._restyle()

    def show_applying(self) -> None:
        self.status.setText("Applying…")
        self.status.setProperty("state", "")
        self._restyle()

    def show_result(self, action: str, before, after) -> None:
        words = {"compacted": "Compacted the live cache", "rebuilt": "Rebuilt the cache from the transcript",
                 "recalled": "Recalled from the cold tier (nothing re-read)",
                 "deferred": "Deferred to the end of the reply", "unchanged": "No change",
                 "set": "Set for this chat (its cache is read with them at its next question)",
                 "sent": "Sent to the server with the next request (it applies them before reading the turn)",
                 "unsupported": "Not applied: this server has no DS-V4.1 cache"}
        text = words.get(action, action)
        if before is not None and after is not None:
            text += (f": KV {fmt_bytes(before.kv_stored)} → {fmt_bytes(after.kv_stored)}"
                     f" (engine {fmt_bytes(before.used_by_engine)} → {fmt_bytes(after.used_by_engine)})")
        self.status.setText("✓ " + text)
        self.status.setProperty("state", "applied")
        self._restyle()

    def show_error(self, message: str) -> None:
        self.status.setText("⚠ " + message)
        self.status.setProperty("state", "error")
        self._restyle()

    def _restyle(self) -> None:
        self.status.style().unpolish(self.status)
        self.status.style().polish(self.status)

    def _show_value(self, spec) -> None:
        value = spec.from_tick(self.sliders[spec.name].value())
        if spec.name == "csa2_topk" and value == 0:
            text = "dense"
        else:
            text = f"{value:.{spec.decimals}f}" if spec.decimals else str(value)
        self.value_labels[spec.name].setText(text)

    def _on_slider(self, spec) -> None:
        self._show_value(spec)
        self._changed()

    def _changed(self, *_args) -> None:
        if not self._quiet:
            self._debounce.start()


def _describe(knobs: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in knobs.items())
