"""What a loaded model says about itself (LoadInfo) and what a reconfigure did (ReconfigureResult): torch-free, so
the app and the remote backend (engine.remote) use them without loading torch."""

from __future__ import annotations

from dataclasses import dataclass

from .memory import MemoryReport


@dataclass(frozen=True)
class LoadInfo:
    source_kind: str
    display_name: str
    folder: str
    resolve_seconds: float  # includes a first-time GGUF conversion
    load_seconds: float
    device: str
    dtype: str
    weight_quant: str
    attention_backend: str
    weight_storage: str = ""  # how the weights are held when it differs from dtype: "bf16" or "int8" (kernels)
    prefill_bf16: bool = False  # prefill multiplies the bf16-held matrices in bf16 (adapter.set_prefill_bf16)
    attention_kernels: str = ""  # which kernel each attention call runs (attention.attention_kernels)
    remote: str = ""  # "" in this process; "dsv41": our server (engine.remote); "openai": another OpenAI-compatible one

    @property
    def weights(self) -> str:
        """How the weights are held, in words: "int8", "held as GGUF Q4_1 + Q8_0", "held as bf16", or the dtype's."""
        if self.weight_quant != "none" or not self.weight_storage:
            return self.weight_quant
        return f"held as {self.weight_storage}"


@dataclass(frozen=True)
class ReconfigureResult:
    action: str  # "compacted" | "recalled" | "rebuilt" | "deferred" | "unchanged"; remote: "sent" | "unsupported";
    # the app's worker for a chat with no live cache: "set" (its next question reads it with them)
    before: MemoryReport | None
    after: MemoryReport | None
