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

    def __init__(self, needed: int, limit: int, parts: dict[str, int] | None = None):
        self.needed, self.limit, self.parts = needed, limit, dict(parts or {})
        detail = ", ".join(f"{k} {v}" for k, v in self.parts.items())
        super().__init__(
            f"This turn needs {needed} tokens but the context holds {limit}"
            + (f" ({detail})" if detail else "")
            + ". Start a new chat, attach a shorter document, or raise max_seq_len (up to the model's positions)."
        )


class BusyError(EngineError):
    """An operation that needs an idle engine was asked for while a turn is running."""
