"""Exceptions the engine raises. Each message says what went wrong and what the user can do."""


class EngineError(Exception):
    """Base class: every error the engine raises on purpose."""


class ConfigError(EngineError, ValueError):
    """A configuration value is out of range. Names the field, the value and what is allowed."""

    def __init__(self, field: str, value, allowed: str):
        self.field, self.value, self.allowed = field, value, allowed
        super().__init__(f"{field}={value!r} is not allowed: {field} must be {allowed}")


class ModelLoadError(EngineError):
    """The model could not be loaded. `reason` is a short code the GUI can branch on."""

    def __init__(self, message: str, *, reason: str = "load_failed", source: str | None = None):
        self.reason, self.source = reason, source
        super().__init__(message)


class ContextOverflowError(EngineError):
    """A turn does not fit the context window; raised before any work is done."""

    def __init__(self, needed: int, limit: int, parts: dict[str, int] | None = None, *,
                 max_positions: int | None = None):
        self.needed, self.limit, self.parts = needed, limit, dict(parts or {})
        detail = ", ".join(f"{k} {v}" for k, v in self.parts.items())
        super().__init__(f"This turn needs {needed} tokens but the context holds {limit}"
                         + (f" ({detail})" if detail else "") + ". " + _overflow_advice(self.parts, limit, max_positions))


def _overflow_advice(parts: dict[str, int], limit: int, max_positions: int | None) -> str:
    """What would make a turn fit, from what takes the room (`parts`; none known: every remedy)."""
    known = bool(parts)
    steps = []
    if parts.get("history") or not known:
        steps.append("start a new chat")
    if parts.get("documents") or not known:
        steps.append("attach a shorter document")
    elif parts.get("prompt"):
        steps.append("shorten the message")
    if max_positions is None:
        steps.append("raise max_seq_len (up to the model's positions)")
    elif limit < max_positions:
        steps.append(f"raise max_seq_len (up to the model's {max_positions} positions)")
    advice = (", ".join(steps[:-1]) + ("," if len(steps) > 2 else "") + " or " + steps[-1]) if len(steps) > 1 \
        else "".join(steps)
    advice = advice[:1].upper() + advice[1:] + "." if advice else ""
    if max_positions is not None and limit >= max_positions:
        advice += f" The context already spans all {max_positions} of the model's positions."
    return advice.strip()


class PinError(EngineError, ValueError):
    """Parts of a document to keep hot that the cache cannot keep (more than its room for them, or not found)."""


class BusyError(EngineError):
    """An operation that needs an idle engine was asked for while a turn is running."""
