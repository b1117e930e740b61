"""Settings kept across starts (window geometry, last model, knobs), behind an enum of keys."""

from __future__ import annotations

import enum
import json

from PySide6.QtCore import QSettings

from . import knobs as K
from .paths import settings_path
from .protocol import GenerationOptions


class Key(enum.Enum):
    GEOMETRY = "window/geometry"
    WINDOW_STATE = "window/state"
    SPLITTER = "window/splitter"
    MODEL = "model/options"  # JSON: model_path, weight_quant, device_map, max_seq_len
    RECENT_MODELS = "model/recent"  # JSON list
    KNOBS = "knobs/values"  # JSON
    GENERATION = "generation/options"  # JSON
    LAST_CONVERSATION = "chat/last_conversation"
    DEFAULT_SYSTEM_PROMPT = "chat/default_system_prompt"  # what a new chat starts with
    DOCUMENTS_FOLDER = "documents/last_folder"  # where the Attach dialogs open (the folder last picked from)
    TEXT_SIZE = "view/text_size"  # per cent of the system font (app/text_size.py)
    DRAFT = "chat/draft"  # JSON: what was in the message box at close (conversation, text, documents' paths)


class Settings:
    def __init__(self, path=None):
        self.qsettings = QSettings(str(path or settings_path()), QSettings.Format.IniFormat)

    def value(self, key: Key, default=None):
        return self.qsettings.value(key.value, default)

    def set(self, key: Key, value) -> None:
        self.qsettings.setValue(key.value, value)

    def json(self, key: Key, default):
        raw = self.qsettings.value(key.value)
        if not raw:
            return default
        try:
            return json.loads(raw)
        except (TypeError, ValueError):
            return default

    def set_json(self, key: Key, value) -> None:
        self.qsettings.setValue(key.value, json.dumps(value))

    # ------------------------------------------------------------------ typed helpers
    def model_options(self) -> dict:
        """The model options saved at the last load; a value of the wrong type (a hand-edited or damaged file) is
        left out, so its default is used."""
        options = self.json(Key.MODEL, {})
        if not isinstance(options, dict):
            return {}
        kinds = {"model_path": str, "weight_quant": str, "device_map": str, "api_key": str}
        kept = {k: v for k, v in options.items() if k in kinds and isinstance(v, kinds[k])}
        seq = options.get("max_seq_len")
        if isinstance(seq, int) and not isinstance(seq, bool) and 0 < seq <= 2**31 - 1:
            kept["max_seq_len"] = seq
        return kept

    def state(self, key: Key) -> bytes | None:
        """A saved window geometry or splitter state: bytes, or None (a damaged value is ignored)."""
        value = self.value(key)
        return bytes(value) if isinstance(value, (bytes, bytearray)) or type(value).__name__ == "QByteArray" \
            else None

    def knobs(self) -> dict:
        stored = self.json(Key.KNOBS, {})
        return K.sanitize(stored if isinstance(stored, dict) else {})

    def generation(self) -> GenerationOptions:
        return GenerationOptions.from_dict(self.json(Key.GENERATION, {}))

    def default_system_prompt(self) -> str:
        value = self.value(Key.DEFAULT_SYSTEM_PROMPT, "")
        return value if isinstance(value, str) else ""

    def last_conversation(self) -> int | None:
        value = self.value(Key.LAST_CONVERSATION)
        try:
            number = int(value) if value not in (None, "") else None
        except (TypeError, ValueError):
            return None
        return number if number is not None and 0 < number < 2**63 else None

    def sync(self) -> None:
        self.qsettings.sync()
