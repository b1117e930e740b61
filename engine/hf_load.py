"""What every load of weights through transformers shares, a folder's (engine.loader) and a GGUF's
conversion (engine.gguf): silence transformers' chatter while it loads, and refuse weights that are
not finite numbers."""

from __future__ import annotations

import warnings

from .errors import ModelLoadError


def check_finite(model, name: str, *, what: str) -> None:
    """Refuse a model whose floating-point weights hold NaN or infinity (damaged bytes): it would load and
    answer with empty text. Quantized (integer) tensors are not checked."""
    import torch

    bad = []
    with torch.no_grad():
        for tensor_name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
            if not tensor.is_floating_point() or not tensor.numel():
                continue
            # min and max propagate NaN and show ±inf, and allocate nothing the size of the tensor (a full
            # isfinite mask per weight left ~190 MB more resident after loading the default model)
            low, high = torch.aminmax(tensor.detach().reshape(-1))
            if not (bool(torch.isfinite(low)) and bool(torch.isfinite(high))):
                bad.append(tensor_name)
    if bad:
        shown = ", ".join(bad[:3]) + (f" and {len(bad) - 3} more" if len(bad) > 3 else "")
        raise ModelLoadError(f"{name} is damaged: {len(bad)} weight tensor(s) hold values that are not numbers "
                             f"(NaN or infinity): {shown}. {what}", reason="corrupt", source=name)


class _quiet_transformers:
    """Silence progress bars and chatter during a load (errors still raise)."""

    def __enter__(self):
        from transformers.utils import logging as hf_logging

        self._level = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()
        self._bars = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()
        self._warn = warnings.catch_warnings()
        self._warn.__enter__()
        warnings.simplefilter("ignore")
        return self

    def __exit__(self, *exc):
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity(self._level)
        if self._bars:
            hf_logging.enable_progress_bar()
        self._warn.__exit__(*exc)
        return False
