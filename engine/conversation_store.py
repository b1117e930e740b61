"""Saved conversation caches: after each turn a chat's cache is written to the user cache folder, so reopening
the chat (also after a restart), regenerating a reply or editing a message restores it instead of re-reading
the whole conversation.

A state is found by what it holds, not by a chat id: its file records the model and cache settings it was made
with and the rendered conversation text it stands for (its length, a hash and where the template's control tokens
are). A session that would have to re-read its conversation asks for the longest saved state whose text starts
the conversation it renders now (ChatSession.prepare): reopening a chat finds the state after its last turn;
regenerating or editing the last message finds the one after the turn before. Another model, other settings or
another conversation never match.

Files are safetensors (the cache's tensors and the transcript's token ids; the facts as JSON in the header),
written to a temporary name and renamed (a crash while saving leaves the earlier files as they were), with a
digest of every byte checked before a state is used: a corrupt, truncated or foreign file is refused, and the
conversation is re-read as if there were none. The folder is capped (`conversation_cache_mb`); the states
used least recently are removed first. A temporary file counts in the cap too; one whose writer is gone (killed
while saving: the process its name carries runs no more, or it was not written for an hour) is removed when the
store opens and at every save. A file a live process is writing is never touched.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SUFFIX = ".dsv41state"
HEADER_KEY = "dsv41"
TMP_SUFFIX = ".tmp"
STALE_TMP_SECONDS = 3600  # a temporary file not written for this long is a dead save's, whoever has its pid now
_writing: set[str] = set()  # names of the temporary files this process is writing now (its others: dead saves')


def _tmp_name(path: Path) -> Path:
    """Where a state is written before it is renamed to `path`: the writer's pid is in the name."""
    return path.with_name(f".{path.name}.{os.getpid()}{TMP_SUFFIX}")


def _writer_gone(path: Path, mtime: float) -> bool:
    """Whether the save that wrote this temporary file is over (it was killed): its name carries this process and
    this process is not writing it, or another process that runs no more, or it was not written for
    STALE_TMP_SECONDS (its pid taken by another program since, or a name without a pid)."""
    try:
        pid = int(path.name[: -len(TMP_SUFFIX)].rpartition(".")[2])
    except ValueError:
        pid = None
    if pid == os.getpid():
        return path.name not in _writing
    if time.time() - mtime > STALE_TMP_SECONDS:
        return True
    if pid is None:
        return False
    import psutil

    return not psutil.pid_exists(pid)


def text_digest(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def key_of(value) -> str:
    """A stable digest of a JSON-able value (a model's or settings' identity)."""
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()[:32]


def _digest(tensors: dict[str, torch.Tensor], header: str) -> str:
    h = hashlib.blake2b(header.encode(), digest_size=32)
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        h.update(name.encode())
        h.update(str((tuple(t.shape), str(t.dtype))).encode())
        if t.numel():
            h.update(t.reshape(-1).view(torch.uint8).numpy().data)
    return h.hexdigest()


@dataclass(frozen=True)
class SavedState:
    path: Path
    facts: dict  # the header: model, settings, text_len, text_sha, specials, cache facts


@dataclass(frozen=True)
class Restored:
    tensors: dict[str, torch.Tensor]
    facts: dict
    transcript_ids: list[int]


class ConversationStore:
    def __init__(self, folder: Path, cap_bytes: int):
        self.folder = Path(folder)
        self.cap_bytes = int(cap_bytes)
        self.last_error: str | None = None  # why the last save failed (the chat goes on without it)
        self._total: int | None = None  # bytes of the folder's files, kept by trim (None: not counted yet)
        try:
            self._scan()  # a save killed last time leaves its temporary file: removed now
        except OSError:
            pass

    # ------------------------------------------------------------------ writing
    def save(self, *, model_key: str, settings_key: str, text: str, specials, transcript_ids: list[int],
             tensors: dict[str, torch.Tensor], cache_facts: dict, layout_key: str = "",
             knobs: dict | None = None) -> Path | None:
        """Write one state (atomically) and trim the folder to its cap. Returns the file, or None when it was
        not saved (too large for the cap, or the disk refused: said in `last_error`, never raised)."""
        from safetensors.torch import save_file

        facts = {"model": model_key, "settings": settings_key, "text_len": len(text), "text_sha": text_digest(text),
                 "specials": [list(s) for s in specials], "cache": cache_facts, "saved_at": time.time(),
                 "layout": layout_key, "knobs": knobs or {}}
        payload = dict(tensors)
        payload["transcript_ids"] = torch.tensor(transcript_ids, dtype=torch.int64)
        size = sum(t.numel() * t.element_size() for t in payload.values())
        if size > self.cap_bytes:
            self.last_error = f"the state ({size / 2**20:.0f} MB) is larger than the cap ({self.cap_bytes / 2**20:.0f} MB)"
            return None
        header = json.dumps(facts, sort_keys=True)
        meta = {HEADER_KEY: header, "digest": _digest(payload, header)}
        path = self.folder / (key_of([model_key, settings_key, facts["text_sha"]]) + SUFFIX)
        tmp = _tmp_name(path)
        _writing.add(tmp.name)
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            save_file(payload, str(tmp), metadata=meta)
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except Exception as exc:  # noqa: BLE001 - OSError, or safetensors' own error for a full disk: not saved
            reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            said = self.last_error is not None
            self.last_error = (f"could not save the conversation cache in {self.folder}: {reason}. The chat goes on "
                               "(it is re-read when reopened); free space there or set DSV41_CACHE_DIR elsewhere.")
            if not said:  # once while saves keep failing, not at every turn
                log.warning(self.last_error)
            tmp.unlink(missing_ok=True)
            return None
        finally:
            _writing.discard(tmp.name)
        self.last_error = None
        self.trim(keep=path)
        return path

    def _scan(self) -> tuple[list[tuple[float, int, Path]], int]:
        """The states as (mtime, size, path), and the bytes of the temporary files still being written; a temporary
        file whose writer is gone (_writer_gone) is removed on the way."""
        if not self.folder.is_dir():
            return [], 0
        files, writing = [], 0
        for p in self.folder.iterdir():
            try:
                st = p.stat()
                if p.name.endswith(TMP_SUFFIX):
                    if _writer_gone(p, st.st_mtime):
                        p.unlink(missing_ok=True)  # a save that never finished
                    else:
                        writing += st.st_size
                elif p.suffix == SUFFIX:
                    files.append((st.st_mtime, st.st_size, p))
            except OSError:  # gone meanwhile, or held open by its writer (Windows)
                continue
        return files, writing

    def trim(self, keep: Path | None = None) -> None:
        """Remove the least recently used states until the folder (temporary files of saves under way included)
        fits its cap, and the leftovers of a save that was killed."""
        files, writing = self._scan()
        total = writing + sum(size for _, size, _ in files)
        for _, size, p in sorted(files):
            if total <= self.cap_bytes:
                break
            if p != keep and _remove(p):
                total -= size
        self._total = total

    def forget(self, text: str) -> int:
        """Remove every state of a conversation whose rendered text is `text` (a deleted chat): each one whose
        text starts it, whatever model or settings made it. Returns how many were removed."""
        removed = 0
        for path in list(self.folder.glob("*" + SUFFIX)) if self.folder.is_dir() else []:
            facts = self._header(path)
            n = facts.get("text_len") if facts else None
            if isinstance(n, int) and n <= len(text) and text_digest(text[:n]) == facts.get("text_sha"):
                removed += _remove(path)
        self._total = None
        return removed

    def discard(self, path: Path) -> None:
        """Remove a state that was refused (unreadable, or it does not fit the cache it was meant for); one that
        cannot be removed (a folder by that name, a file the user may not delete) is left, and passed over."""
        _remove(path)
        self._total = None

    def total_bytes(self) -> int:
        """Bytes of the saved states and of the temporary files of saves under way (counted once, then kept up to
        date by every save; the memory report reads it every few seconds during a reply, so it does not walk the
        folder each time)."""
        if self._total is None:
            self.trim()
        return self._total or 0

    # ------------------------------------------------------------------ finding and reading
    def find(self, *, model_key: str, settings_key: str, rendered, layout_key: str = "") -> SavedState | None:
        """The saved state of this model and settings whose conversation text is the longest start of
        `rendered` (a chat_template.Rendered), with the same control tokens in it; None when there is none. With
        `layout_key`, a state made under other settings of the same layout (engine.saved_state: only the knobs that
        move the budget differ) counts too, after one of these settings as long."""
        if not self.folder.is_dir():
            return None
        best = None
        for path in self.folder.glob("*" + SUFFIX):
            facts = self._header(path) if path.is_file() else None
            if facts is None:  # not a state (damaged, or not ours): it can never be used
                self.discard(path)
                continue
            exact = facts.get("settings") == settings_key
            if facts.get("model") != model_key or not (exact or (layout_key and facts.get("layout") == layout_key)):
                continue
            n = facts.get("text_len")
            if not isinstance(n, int) or n > len(rendered.text) or (best is not None and (
                    n < best.facts["text_len"] or n == best.facts["text_len"]
                    and (best.facts.get("settings") == settings_key or not exact))):
                continue
            if text_digest(rendered.text[:n]) != facts.get("text_sha"):
                continue
            if not rendered.extends(rendered.text[:n], tuple(tuple(s) for s in facts.get("specials", ()))):
                continue
            best = SavedState(path, facts)
        return best

    def load(self, state: SavedState) -> Restored | None:
        """Read and verify a state found by `find`; None (and the file removed) when it is corrupt or truncated."""
        from safetensors import safe_open
        from safetensors.torch import load_file

        try:
            with safe_open(str(state.path), "pt") as f:
                meta = f.metadata() or {}
            tensors = load_file(str(state.path))
            if meta.get(HEADER_KEY) is None or _digest(tensors, meta[HEADER_KEY]) != meta.get("digest"):
                raise ValueError("its contents do not match its digest")
            ids = tensors.pop("transcript_ids")
        except Exception as exc:  # noqa: BLE001 - any unreadable file is refused the same way
            log.warning("refused the saved conversation cache %s: %s", state.path.name, exc)
            self.discard(state.path)
            return None
        try:
            os.utime(state.path)  # used now: the last to be removed
        except OSError:
            pass
        return Restored(tensors, json.loads(meta[HEADER_KEY]), ids.tolist())

    @staticmethod
    def _header(path: Path) -> dict | None:
        from safetensors import safe_open

        try:
            with safe_open(str(path), "pt") as f:
                meta = f.metadata() or {}
            return json.loads(meta[HEADER_KEY])
        except Exception:  # noqa: BLE001 - any unreadable header is refused the same way
            return None


def _remove(path: Path) -> bool:
    """Delete a state's file; False (logged) where it cannot be: the store goes on without it, never fails a turn."""
    try:
        path.unlink(missing_ok=True)
    except OSError as exc:
        log.warning("could not remove the saved conversation cache %s: %s", path.name, exc)
        return False
    return True
