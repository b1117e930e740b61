"""The knob panel: changes reach the engine only between turns, presets, the KV-over-weights hint, settings kept."""

from __future__ import annotations

from conftest import send


def slider_to(window, name, value):
    from app import knobs as K

    spec = next(s for s in K.SLIDERS if s.name == name)
    window.knob_panel.sliders[name].setValue(spec.to_tick(value))


def test_a_knob_change_during_a_reply_is_pending_and_applied_after_it(qtbot, window, fake_model):
    fake_model.token_delay = 0.05
    fake_model.reply_text = " ".join(f"w{i}" for i in range(40))
    send(qtbot, window, "Stream for a while", wait=False)
    qtbot.waitUntil(lambda: bool(window.turns.active and window.turns.active.text), timeout=5_000)
    slider_to(window, "kv_cache_ratio", 0.3)
    qtbot.waitUntil(lambda: "Pending" in window.knob_panel.status.text(), timeout=2_000)
    assert "kv_cache_ratio=0.3" in window.knob_panel.status.text()
    assert "reconfigure" not in fake_model.names()
    qtbot.waitUntil(lambda: "reconfigure" in fake_model.names(), timeout=10_000)

    names = fake_model.names()
    assert names.index("reconfigure") > names.index("turn_end")
    reconfigure = next(c for c in fake_model.calls if c[0] == "reconfigure")
    assert reconfigure[3]["busy"] is False and reconfigure[3]["knobs"]["kv_cache_ratio"] == 0.3
    assert reconfigure[2] != "MainThread"  # ran on the worker thread
    qtbot.waitUntil(lambda: "Compacted" in window.knob_panel.status.text(), timeout=2_000)
    assert "→" in window.knob_panel.status.text()  # before → after memory
    assert fake_model.config.kv_cache_ratio == 0.3


def test_a_knob_change_between_turns_applies_at_once(qtbot, window, fake_model):
    slider_to(window, "ced_decay", 0.98)
    qtbot.waitUntil(lambda: fake_model.config.ced_decay == 0.98, timeout=3_000)
    assert window.knob_panel.value_labels["ced_decay"].text() == "0.980"


def test_presets_set_every_knob(qtbot, window, fake_model):
    window.knob_panel.apply_preset("Long document")
    qtbot.waitUntil(lambda: fake_model.config.ced_decay == 0.998, timeout=3_000)
    assert fake_model.config.csa2_topk == 512
    window.knob_panel.apply_preset("Min memory")
    qtbot.waitUntil(lambda: fake_model.config.kv_cache_dtype == "int8", timeout=3_000)
    assert fake_model.config.kv_cache_ratio == 0.2
    window.knob_panel.apply_preset("Max quality")
    qtbot.waitUntil(lambda: fake_model.config.kv_cache_ratio == 1.0, timeout=3_000)
    assert fake_model.config.csa2_topk == 0
    assert window.knob_panel.value_labels["csa2_topk"].text() == "dense"


def test_sliders_choices_and_defaults_come_from_the_engines_registry():
    from app import knobs as K
    from engine.config import KNOBS, USER_DEFAULTS

    assert [s.name for s in K.SLIDERS] == ["kv_cache_ratio", "ced_decay", "ced_threshold", "csa2_topk"]
    for spec in K.SLIDERS:
        knob = KNOBS[spec.name]
        assert (spec.minimum, spec.maximum, spec.step, spec.decimals) == (
            knob.slider.minimum, knob.slider.maximum, knob.slider.step, knob.slider.decimals)
        assert (spec.label, spec.tip) == (knob.label, knob.help)
        assert knob.lo <= spec.minimum < spec.maximum <= knob.hi
        assert spec.from_tick(spec.ticks) == spec.maximum and spec.from_tick(0) == spec.minimum
    ratio = K.SLIDER["kv_cache_ratio"]
    assert (ratio.minimum, ratio.maximum) == (KNOBS["kv_cache_ratio"].lo, KNOBS["kv_cache_ratio"].hi) == (0.01, 1.0)
    assert [v for v, _ in K.CED_MODES] == list(KNOBS["ced_mode"].kind)
    assert [v for v, _ in K.KV_DTYPES] == list(KNOBS["kv_cache_dtype"].kind)
    assert K.DEFAULTS == {name: USER_DEFAULTS.get(name, KNOBS[name].default) for name in K.KNOB_NAMES}
    assert K.DEFAULTS["cold_tier"] == "ram" and KNOBS["cold_tier"].default == "off"  # the app tiers by default


def test_sanitize_keeps_what_the_engine_accepts_and_snaps_sliders_to_their_step():
    from app import knobs as K

    out = K.sanitize({"kv_cache_ratio": 0.014, "ced_decay": 2.0, "ced_threshold": True, "csa2_topk": 250,
                      "ced_mode": "fold", "kv_cache_dtype": "int8", "prefill_headroom": 3000, "weight_quant": "int8"})
    assert out["kv_cache_ratio"] == 0.01  # the engine allows it; the slider's step is 0.01
    assert out["csa2_topk"] == 256  # snapped to the step of 16
    assert out["kv_cache_dtype"] == "int8"
    for name in ("ced_decay", "ced_threshold", "ced_mode"):  # refused by KNOBS[name].validate
        assert out[name] == K.DEFAULTS[name]
    assert out["prefill_headroom"] is None  # not a step of the combo box
    assert set(out) == set(K.KNOB_NAMES)
    assert K.sanitize({}) == K.DEFAULTS


def test_the_ratio_slider_reaches_below_a_tenth(qtbot, window, fake_model):
    slider_to(window, "kv_cache_ratio", 0.05)
    qtbot.waitUntil(lambda: fake_model.config.kv_cache_ratio == 0.05, timeout=3_000)
    assert window.knob_panel.value_labels["kv_cache_ratio"].text() == "0.05"


def test_memory_panel_shows_the_kv_line_and_the_hint(qtbot, window, fake_model):
    fake_model.reply_text = "ok"
    send(qtbot, window, "x" * 40_000)  # ~10k tokens seen: KV > 30 % of the weights
    qtbot.waitUntil(lambda: bool(window.memory_panel.hint_label.text()), timeout=5_000)
    assert "of the weights" in window.memory_panel.hint_label.text()
    assert "30 %" in window.memory_panel.hint_label.toolTip()
    kv = window.memory_panel.values["KV cache"].text()
    assert "(from " in kv and "×0.50" in kv
    assert window.memory_panel.ratio_label.text() == "Compression: target 0.50 · now ×0.50"
    assert window.memory_panel.device_label.text().startswith("CPU")
    assert len(window.memory_panel.timeline.samples) >= 1
    qtbot.waitUntil(lambda: window.figures is not None and window.figures.history > 0, timeout=3_000)
    assert "/ 8,192 tokens" in window.memory_panel.context_label.text()


def test_memory_panel_warns_when_the_cache_keeps_too_little(qtbot, window, fake_model):
    slider_to(window, "kv_cache_ratio", 0.2)
    qtbot.waitUntil(lambda: fake_model.config.kv_cache_ratio == 0.2, timeout=3_000)
    fake_model.reply_text = "ok"
    send(qtbot, window, "x" * 4_000)  # ~1k tokens: the KV stays far below 30 % of the weights
    panel = window.memory_panel
    qtbot.waitUntil(lambda: bool(panel.hint_label.text()), timeout=5_000)
    text = panel.hint_label.toolTip()
    assert "answers measurably worsen" in text and "20 %" in text and "of the weights" not in text
    assert "answers may drift" in panel.hint_label.text()
    below = panel.timeline.geometry().top()
    slider_to(window, "kv_cache_ratio", 0.5)
    qtbot.waitUntil(lambda: not panel.hint_label.text(), timeout=5_000)
    assert panel.timeline.geometry().top() == below  # the panel does not jump when the warning goes


def test_knobs_and_model_choice_are_kept_across_starts(qtbot, make_window, fake_model):
    first = make_window()
    slider_to(first, "ced_threshold", 0.25)
    first.knob_panel.greedy.setChecked(True)
    first.model_panel.max_seq_len.setValue(4096)
    first.model_panel.request_load()
    qtbot.waitUntil(lambda: first.facts is not None and first.facts.context_limit == 4096, timeout=5_000)
    first.close()
    second = make_window()
    assert second.knob_panel.values()["ced_threshold"] == 0.25
    assert second.knob_panel.greedy.isChecked()
    assert second.model_panel.max_seq_len.value() == 4096
    assert second.facts.config["ced_threshold"] == 0.25  # the knobs go into the load, too


def test_the_compression_line_says_why_the_cache_is_not_at_the_slider(qtbot, window, fake_model):
    fake_model.reply_text = "ok"
    send(qtbot, window, "short")  # a few tokens: the budget floor keeps them all
    label = window.memory_panel.ratio_label
    qtbot.waitUntil(lambda: "target 0.50" in label.text(), timeout=5_000)
    assert "now ×1.00" in label.text() and "a short chat is kept whole (floor 128 entries)" in label.text()
    assert label.toolTip() == label.text()


def test_a_reply_sent_while_a_knob_change_is_applied_records_the_knobs_it_was_made_with(qtbot, window, fake_model):
    # the change is sent before the turn and applied before it is read; the window's facts catch up only when the
    # result comes back, so the reply's recorded knobs come from the panel
    window.knob_panel.set_values({"kv_cache_ratio": 0.3})
    window.knob_panel.knobs_changed.emit(window.knob_panel.values())  # as the debounce does
    send(qtbot, window, "Right after the change")
    reply = window.store.messages(window.conversation_id)[-1]
    assert reply.settings["knobs"]["kv_cache_ratio"] == 0.3
    assert fake_model.config.kv_cache_ratio == 0.3
