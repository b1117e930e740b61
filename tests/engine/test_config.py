import pytest

from engine import ConfigError, DSV41Config


def test_defaults_match_design():
    c = DSV41Config()
    assert (c.model_path, c.max_seq_len, c.kv_cache_ratio, c.ced_decay, c.ced_threshold, c.ced_mode) == (
        "default", 8192, 0.5, 0.995, 0.1, "evict")
    assert (c.ced_sink_tokens, c.ced_recent_tokens, c.csa2_topk, c.csa2_rank) == (4, 32, 256, None)
    assert (c.use_flash_attention, c.weight_quant, c.kv_cache_dtype, c.dtype, c.device_map) == (
        True, "none", "auto", "auto", "auto")
    assert (c.prefill_chunk, c.prefill_headroom) == (None, None)
    assert not hasattr(c, "kv_cache_shard")  # every layer's KV lives on its layer's device: no knob for it


def test_seed_call_is_accepted():
    c = DSV41Config(model_path="default", max_seq_len=8192, kv_cache_ratio=0.5, ced_threshold=0.1,
                    use_flash_attention=True, csa2_topk=256)
    assert c.csa2_topk == 256


@pytest.mark.parametrize("field,value,allowed", [
    ("kv_cache_ratio", 1.5, "[0.01, 1.0]"),
    ("kv_cache_ratio", 0.0, "[0.01, 1.0]"),
    ("ced_decay", 1.2, "[0.5, 1.0]"),
    ("ced_threshold", -0.1, "[0.0, 1.0]"),
    ("ced_mode", "squash", "'merge', 'evict'"),
    ("csa2_topk", -1, "[0, 65536]"),
    ("csa2_rank", 0, "[1, 1024]"),
    ("max_seq_len", 8, "[16, 1048576]"),
    ("weight_quant", "int3", "'none', 'int8', 'int4'"),
    ("kv_cache_dtype", "fp8", "'auto', 'int8'"),
    ("dtype", "float64", "'auto', 'float32'"),
    ("device_map", "tpu", "'auto', 'cpu', 'cuda'"),
    ("prefill_headroom", -5, "None (auto)"),
    ("use_flash_attention", "yes", "bool"),
    ("ced_sink_tokens", 2.5, "integer"),
])
def test_bad_values_name_field_value_and_range(field, value, allowed):
    with pytest.raises(ConfigError) as err:
        DSV41Config(**{field: value})
    message = str(err.value)
    assert message.startswith(f"{field}={value!r}")
    assert allowed in message
    assert err.value.field == field


def test_replace_validates_and_rejects_unknown_fields():
    c = DSV41Config()
    assert c.replace(kv_cache_ratio=0.3).kv_cache_ratio == 0.3
    with pytest.raises(ConfigError, match="kv_cache_ratio"):
        c.replace(kv_cache_ratio=2)
    with pytest.raises(ConfigError, match="DSV41Config field"):
        c.replace(cache_ratio=0.3)


def test_the_docs_table_is_the_registry():
    from pathlib import Path

    from engine.config import knobs_table

    doc = (Path(__file__).resolve().parents[2] / "docs" / "knobs.md").read_text(encoding="utf-8")
    assert knobs_table() in doc, "docs/knobs.md is out of date: paste engine.config.knobs_table() into it"


def test_every_field_is_a_registry_knob_and_validates_from_it():
    import dataclasses

    from engine.cache import CacheSettings
    from engine.config import KNOBS, KNOBS_LIST

    assert [f.name for f in dataclasses.fields(DSV41Config)] == [k.name for k in KNOBS_LIST]
    assert {f.name for f in dataclasses.fields(CacheSettings)} == {k.name for k in KNOBS_LIST if k.cache}
    for knob in KNOBS_LIST:
        knob.validate(knob.default)
        if knob.slider is not None:  # the GUI's slider stays inside what the config accepts
            assert knob.lo <= knob.slider.minimum < knob.slider.maximum <= knob.hi
        if knob.cache and knob.applies == "cache":
            assert knob.looser in ("up", "down", "change")
    with pytest.raises(ConfigError, match="ced_sink_tokens"):
        CacheSettings(ced_sink_tokens=-1)
    assert KNOBS["kv_cache_ratio"].is_looser(0.3, 0.5) and not KNOBS["kv_cache_ratio"].is_looser(0.5, 0.3)
    assert KNOBS["ced_threshold"].is_looser(0.2, 0.1) and KNOBS["ced_mode"].is_looser("evict", "merge")
    assert CacheSettings().needs_rebuild(CacheSettings(kv_cache_dtype="int8"))
    assert not CacheSettings().needs_rebuild(CacheSettings(kv_cache_ratio=0.3, ced_decay=0.99, csa2_topk=64))


def test_cli_flags_come_from_the_registry():
    from engine.cli import build_parser
    from engine.config import KNOBS_LIST

    args = build_parser().parse_args(["chat", "--ced-policy", "h2o", "--csa2-rank", "4", "--prefill-headroom", "1.5",
                                      "--ced-recent-tokens", "16"])
    assert (args.ced_policy, args.csa2_rank, args.prefill_headroom, args.ced_recent_tokens) == ("h2o", 4, 1.5, 16)
    flags = {a.dest for a in build_parser()._subparsers._group_actions[0].choices["chat"]._actions}
    assert {k.name for k in KNOBS_LIST if k.cli} <= flags


def test_a_prefill_headroom_past_any_machine_is_refused_before_loading():
    # 1e308 GB passed the check and crashed the first turn (int(inf))
    from engine import ConfigError, DSV41Config

    for bad in (1e308, 2e6, 2**41):
        with pytest.raises(ConfigError, match="prefill_headroom"):
            DSV41Config(prefill_headroom=bad)
    assert DSV41Config(prefill_headroom=64.0).prefill_headroom == 64.0
