"""Models from the Hugging Face hub: a repository's files with their sizes, the choices they make (the
safetensors set, or one .gguf file), and a download with progress, cancel and clear errors -- all through
huggingface_hub's own machinery (HfApi.model_info, hf_hub_download with a progress class). No Qt, no torch: the
window runs it on a worker thread (widgets/download_dialog.py).

Where: <user data folder>/models/<owner>--<name>/, the files as the repository lays them out. What a download
keeps when it is cancelled or fails: every file finished before (a later download of the same choice skips them:
"resume" at file granularity); the file in flight is dropped by huggingface_hub (2.x downloads each file to a
process-unique temporary file and never leaves a half file at its final place). Within one file, a dropped
connection is resumed by huggingface_hub itself.
"""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from .paths import data_dir

# besides the weights, what a safetensors model folder needs to load
SUPPORT_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                 "special_tokens_map.json", "tokenizer.model", "vocab.json", "merges.txt",
                 "model.safetensors.index.json", "chat_template.jinja")


class DownloadError(Exception):
    """A message the user can act on."""


class DownloadCancelled(Exception):
    pass


@dataclass(frozen=True)
class Choice:
    """One way to get the model: its label, the files, their total size, and what it is."""

    label: str
    files: tuple[str, ...]
    sizes: tuple[int, ...]  # each file's bytes
    kind: str  # "safetensors" or "gguf"
    weights_size: int  # the weight files' bytes (the fit estimate's input)

    @property
    def size(self) -> int:
        return sum(self.sizes)

    @property
    def local_name(self) -> str:
        """What the engine loads once downloaded, relative to the repository folder ('' = the folder)."""
        return self.files[0] if self.kind == "gguf" else ""


@dataclass(frozen=True)
class RepoFiles:
    repo_id: str
    sizes: dict[str, int]
    choices: tuple[Choice, ...]


@dataclass(frozen=True)
class Progress:
    done: int
    total: int
    seconds: float
    file: str

    @property
    def speed(self) -> float:
        return self.done / self.seconds if self.seconds > 0 else 0.0

    @property
    def remaining_s(self) -> float | None:
        return (self.total - self.done) / self.speed if self.speed > 0 else None

    def describe(self) -> str:
        """'120 MB / 540 MB · 35.2 MB/s · 12 s left'."""
        left = self.remaining_s
        eta = f" · {left:,.0f} s left" if left is not None and self.done < self.total else ""
        return f"{self.done / 1e6:,.0f} MB / {self.total / 1e6:,.0f} MB · {self.speed / 1e6:.1f} MB/s{eta}"


def hub_endpoint(endpoint: str | None = None) -> str | None:
    """The hub to talk to: `endpoint`, else HF_ENDPOINT as it is now (huggingface_hub reads it once, at import)."""
    return endpoint or os.environ.get("HF_ENDPOINT") or None


def models_dir() -> Path:
    return data_dir() / "models"


def target_folder(repo_id: str) -> Path:
    return models_dir() / repo_id.replace("/", "--")


def list_files(repo_id: str, *, endpoint: str | None = None, token: str | None = None) -> RepoFiles:
    """The repository's files and sizes, and the choices they make."""
    from huggingface_hub import HfApi

    repo_id = repo_id.strip().strip("/")
    if repo_id.count("/") != 1 or " " in repo_id:
        raise DownloadError(f"“{repo_id}” is not a hub repository id: write it as owner/name, for example "
                            "HuggingFaceTB/SmolLM2-360M-Instruct.")
    try:
        info = HfApi(endpoint=hub_endpoint(endpoint), token=token).model_info(repo_id, files_metadata=True)
    except Exception as exc:  # noqa: BLE001 - said in words below
        raise DownloadError(_explain(exc, repo_id)) from exc
    sizes = {s.rfilename: int(s.size or 0) for s in info.siblings or ()}
    return RepoFiles(repo_id, sizes, choices(sizes))


def choices(sizes: dict[str, int]) -> tuple[Choice, ...]:
    """The safetensors set (weights + config + tokenizer) when there is one, then each .gguf file, largest last."""
    out = []
    shards = sorted(f for f in sizes if f.endswith(".safetensors") and "/" not in f)
    if shards and "config.json" in sizes:
        files = tuple(shards) + tuple(f for f in SUPPORT_FILES if f in sizes)
        weights = sum(sizes[f] for f in shards)
        out.append(Choice(f"safetensors ({len(shards)} file{'s' if len(shards) > 1 else ''})", files,
                          tuple(sizes[f] for f in files), "safetensors", weights))
    for name in sorted((f for f in sizes if f.lower().endswith(".gguf")), key=lambda f: sizes[f]):
        out.append(Choice(name, (name,), (sizes[name],), "gguf", sizes[name]))
    return tuple(out)


def download(repo_id: str, choice: Choice, *, progress=None, cancel: threading.Event | None = None,
             endpoint: str | None = None, token: str | None = None, folder: Path | None = None) -> Path:
    """Fetch `choice`'s files into the repository's folder; returns what the engine loads (the folder, or the
    .gguf file in it). `progress(Progress)` hears every chunk; `cancel` stops at the next one (DownloadCancelled)."""
    from huggingface_hub import hf_hub_download
    from tqdm.auto import tqdm

    folder = folder or target_folder(repo_id)
    cancel = cancel or threading.Event()
    started = time.monotonic()
    done_before = 0
    current = {"file": ""}

    class Reporter(tqdm):  # huggingface_hub's progress hook: every chunk written
        def __init__(self, *args, **kwargs):
            kwargs["disable"] = True  # nothing printed; the app shows it
            super().__init__(*args, **kwargs)
            self.count = 0

        def update(self, n=1):
            if cancel.is_set():
                raise DownloadCancelled()
            self.count += n or 0
            if progress is not None:
                progress(Progress(done_before + self.count, choice.size, time.monotonic() - started,
                                  current["file"]))

    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise DownloadError(f"Cannot write to {folder} ({exc.strerror or exc}). Free some space or make the folder "
                            "writable.") from exc
    for name, size in zip(choice.files, choice.sizes, strict=True):
        if cancel.is_set():
            raise DownloadCancelled()
        current["file"] = name
        try:
            hf_hub_download(repo_id, name, local_dir=folder, endpoint=hub_endpoint(endpoint), token=token,
                            tqdm_class=Reporter)
        except DownloadCancelled:
            raise
        except Exception as exc:  # noqa: BLE001
            raise DownloadError(_explain(exc, repo_id, name)) from exc
        done_before += size
        if progress is not None:
            progress(Progress(done_before, choice.size, time.monotonic() - started, name))
    (folder / "dsv41_download.json").write_text(json.dumps({"repo_id": repo_id, "files": list(choice.files)}))
    return folder / choice.local_name if choice.local_name else folder


def _explain(exc: BaseException, repo_id: str, file: str | None = None) -> str:
    """huggingface_hub's and the network's errors in words, with what to do."""
    name = type(exc).__name__
    text = str(exc)
    if name in ("RepositoryNotFoundError", "GatedRepoError") or "Repository Not Found" in text:
        if name == "GatedRepoError":
            return (f"{repo_id} is gated: accept its licence on huggingface.co and log in (huggingface-cli login), "
                    "then try again.")
        return f"There is no model {repo_id} on the hub (or it is private). Check the id, for example on huggingface.co."
    if name in ("RemoteEntryNotFoundError", "EntryNotFoundError") or "404" in text:
        return f"{repo_id} has no file {file or ''} any more (404). List its files again and pick another choice."
    if name in ("LocalEntryNotFoundError", "OfflineModeIsEnabled", "ConnectError", "ConnectionError",
                "ConnectTimeout", "ReadTimeout", "TimeoutException") or "connect" in text.lower():
        return ("The Hugging Face hub cannot be reached (offline?). Connect to the internet and try again, or pick "
                "a model folder or a .gguf file that is already on this machine (Open → Model folder… / .gguf file…).")
    if "peer closed connection" in text or "RemoteProtocolError" in name or "IncompleteRead" in text:
        return (f"The connection dropped while downloading {file or 'a file'} and could not be resumed. Start the "
                "download again: the files already finished are kept.")
    if isinstance(exc, OSError) and getattr(exc, "errno", None) == 28 or "space" in text.lower():
        return f"Not enough disk space for {file or 'the download'}. Free some space and start it again."
    return f"The download failed: {name}: {text[:300]}"
