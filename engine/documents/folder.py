"""A folder dropped or picked as a document: the documents inside it, in name order, its subfolders included.

Only files whose name says they are a kind the readers take are kept (PDF, Word, text, Markdown, source; a file
with no suffix only where its name is one the readers know, such as README or Makefile): a folder holds programs,
images and archives a user did not mean to attach. Hidden files and folders (a leading dot) and the folders tools
fill (.git, node_modules, __pycache__, a virtual environment) are passed over. The walk stops after MAX_SCANNED
entries and keeps at most MAX_FILES documents, and says so: a folder such as a home folder would take minutes and
hold far more than any context.
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass, field

from .core import _kind_for

MAX_FILES = 50
MAX_SCANNED = 5000
_SKIPPED_DIRS = frozenset({"node_modules", "__pycache__", "site-packages"})  # and any virtual environment


@dataclass
class FolderDocuments:
    folder: str
    files: list[str] = field(default_factory=list)  # the documents to attach, in name order (paths)
    left_out: Counter = field(default_factory=Counter)  # other files by suffix ("" for none): not documents
    more: int = 0  # documents past MAX_FILES, not attached
    cut_short: bool = False  # the walk stopped at MAX_SCANNED entries
    unreadable: str = ""  # why the folder itself could not be listed (permission denied), if it could not

    def summary(self, refused: tuple[str, ...] = ()) -> str:
        """What was attached from the folder and what was not, in a sentence or two ('' when all of it). `refused`:
        its files that could not be read once they were (not counted as attached; named)."""
        name = os.path.basename(os.path.normpath(self.folder)) or self.folder
        if self.unreadable:
            return f'The folder "{name}" could not be opened: {self.unreadable}.'
        attached = len(self.files) - len(refused)
        if not self.files:
            head = f'The folder "{name}" holds no documents the app reads (PDF, Word, text, Markdown or source files).'
        else:
            count = f'{attached} document{"s" if attached != 1 else ""}' if attached else "No document"
            head = f'{count} attached from the folder "{name}".'
        parts = []
        if refused:
            parts.append(f"{len(refused)} could not be read: {', '.join(os.path.basename(p) for p in refused)}.")
        if self.more:
            parts.append(f"{self.more} more were not attached (at most {MAX_FILES} from one folder): drop them "
                         "separately, or a smaller folder.")
        if self.cut_short:
            parts.append(f"Only its first {MAX_SCANNED} entries were looked at: drop the subfolder you mean.")
        if self.left_out:
            total = sum(self.left_out.values())
            kinds = ", ".join(f"{count} {suffix or 'without a suffix'}" for suffix, count in
                              sorted(self.left_out.items(), key=lambda kv: (-kv[1], kv[0]))[:4])
            parts.append(f"{total} other file{'s' if total != 1 else ''} left out ({kinds}).")
        if attached and not parts:
            return ""
        return " ".join([head, *parts])


def folder_documents(folder: str | os.PathLike[str]) -> FolderDocuments:
    """The documents in `folder` and its subfolders (see the module's docstring)."""
    found = FolderDocuments(os.fspath(folder))
    scanned = 0
    documents: list[str] = []
    def failed(exc: OSError) -> None:  # a subfolder that cannot be listed is passed over; the folder itself says why
        if os.path.normpath(exc.filename or "") == os.path.normpath(found.folder):
            found.unreadable = (exc.strerror or str(exc)).lower()

    for root, dirs, files in os.walk(found.folder, onerror=failed):
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d not in _SKIPPED_DIRS
                         and not os.path.exists(os.path.join(root, d, "pyvenv.cfg")))
        for name in sorted(files):
            scanned += 1
            if scanned > MAX_SCANNED:
                found.cut_short = True
                break
            if name.startswith("."):
                continue
            path = os.path.join(root, name)
            if _kind_for(name) is not None and os.path.isfile(path):
                documents.append(path)
            else:
                found.left_out[os.path.splitext(name)[1].lower()] += 1
        if found.cut_short:
            break
    documents.sort(key=lambda p: os.path.relpath(p, found.folder).lower())
    found.files, found.more = documents[:MAX_FILES], max(0, len(documents) - MAX_FILES)
    return found


def documents_or_refuse(folder: str | os.PathLike[str]) -> FolderDocuments:
    """`folder_documents(folder)`, or a DocumentError saying why it gives none (it holds none, or cannot be opened)."""
    from .core import DocumentError

    found = folder_documents(folder)
    if not found.files:
        raise DocumentError(found.summary(), path=os.fspath(folder),
                            reason="unreadable" if found.unreadable else "empty")
    return found
