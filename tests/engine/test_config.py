import pytest

from engine import ConfigError, DSV41Config


def test_defaults_match_design():
    c = DSV41Config()
    assert (c.model_path, c.max_seq_len, c.kv_cache_ratio, c.ced_decay, c.ced_threshold, c.ced_mode) == (
        "default", 8192, 0.5, 0.995, 0.1, "evict")
    assert (c.ced_sink_tokens, c.ced_recent_tokens, c.csa2_topk, c.csa2_rank) == (4, 32, 256, None)
    assert (c.use_flash_attention, c.weight_quant, c.kv_cache_dtype, c.dtype, c.device_map) == (
        True, "none", "auto", "auto", "auto")
    assert (c.kv_cache_shard, c.prefill_chunk, c.prefill_headroom) == (False, None, None)


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
