"""`python -m engine doctor` names the decode kernel a load really uses here: the fused C step (its ISA variant and
x mode) where the CPU decodes through it, the per-op kernel (and why) otherwise; the model panel's line follows
the decoder the load built."""

import re

import pytest
import torch

from engine import doctor
from engine import kernels as cpu_kernels
from engine.kernels.gguf_blocks import x_mode
from engine.models import adapter

needs_kernels = pytest.mark.skipif(cpu_kernels.load() is None, reason=f"CPU kernels: {cpu_kernels.unavailable_reason()}")
on_cpu = pytest.mark.skipif(torch.cuda.is_available(), reason="the default settings decode on the GPU here")


def _decode_part(line: str) -> str:
    found = re.search(r"· decode (.+?) · scored decode", line)
    assert found, line
    return found.group(1)


@needs_kernels
@on_cpu
def test_doctor_names_the_fused_step_with_its_isa_and_x_mode():
    check = doctor._attention_check(torch, False)
    isa = {512: "AVX-512", 256: "AVX2"}[cpu_kernels.load().isa]
    assert _decode_part(check.found) == f"fused C step ({isa}, Q4 x {x_mode()})", check.found
    assert "scored decode fused C step" in check.found


@needs_kernels
@on_cpu
def test_doctor_names_the_per_op_kernel_and_why_when_the_fused_step_is_off(monkeypatch):
    monkeypatch.setenv("DSV41_FUSED_STEP", "0")
    check = doctor._attention_check(torch, False)
    assert "fused C step" not in check.found
    assert "DSV41_FUSED_STEP=0" in check.found
    assert _decode_part(check.found) in ("flash", "math", "memory-efficient", "SDPA", "matmul")
    assert "per-op decode step" in doctor._cpu_kernels_check().found


@needs_kernels
def test_the_model_panel_line_names_the_step_the_decoder_built(tiny_model, monkeypatch):
    model = tiny_model("llama")
    adapter.install(model, pack_rounding=True, pack_format="bf16")
    assert adapter.runtime(model).decoder.fused is not None
    line = adapter.attention_kernels_line(model, "sdpa", torch.device("cpu"))
    assert _decode_part(line).startswith("fused C step (AVX")  # bf16 weights: no Q4 product, no x mode
    monkeypatch.setenv("DSV41_FUSED_STEP", "0")
    model = tiny_model("llama")
    adapter.install(model, pack_rounding=True, pack_format="bf16")
    assert adapter.runtime(model).decoder.fused is None
    assert "fused" not in adapter.attention_kernels_line(model, "sdpa", torch.device("cpu"))


@pytest.mark.model
@needs_kernels
@on_cpu
def test_doctor_and_the_loaded_default_model_name_the_same_decode_kernel(default_model):
    assert adapter.runtime(default_model.hf_model).decoder.fused is not None
    assert _decode_part(doctor._attention_check(torch, False).found) == \
        _decode_part(default_model.info.attention_kernels)
