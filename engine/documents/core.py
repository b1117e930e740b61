"""What every reader of dropped files shares: the kinds of file supported, the public types, and helpers.

The suffix tables decide which reader a file's name claims (``_kind_for``; its content's signature, in ``sniff``,
overrides the name where they disagree) and what a refused file's message suggests instead; :class:`Document` and
:class:`DocumentError` are what the readers return and raise; ``_size``, ``_normalise`` and ``_reason_of`` format
sizes, tidy extracted text and shorten a library's error for a message. The readers (``text``, ``pdf``, ``word``)
import from here, never from the package.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from engine.errors import EngineError

DEFAULT_MAX_BYTES = 64 * 1024 * 1024
DEFAULT_MAX_CHARS = 2_000_000

# --------------------------------------------------------------------------------------------------
# What is supported
# --------------------------------------------------------------------------------------------------

_TEXT_SUFFIXES = frozenset(
    {
        ".txt", ".text", ".log", ".csv", ".tsv", ".json", ".jsonl", ".ndjson", ".rst", ".org",
        ".adoc", ".srt", ".vtt",
    }
)  # fmt: skip
_MARKDOWN_SUFFIXES = frozenset({".md", ".markdown", ".mdown", ".mkd", ".mdx"})
_SOURCE_SUFFIXES = frozenset(
    {
        # general purpose languages
        ".py", ".pyi", ".pyx", ".js", ".mjs", ".cjs", ".jsx", ".ts", ".tsx", ".c", ".h", ".cc",
        ".cpp", ".cxx", ".hpp", ".hh", ".hxx", ".cu", ".cuh", ".cs", ".java", ".kt", ".kts",
        ".scala", ".go", ".rs", ".rb", ".php", ".pl", ".pm", ".lua", ".r", ".swift", ".m", ".mm",
        ".dart", ".hs", ".ml", ".mli", ".ex", ".exs", ".erl", ".clj", ".jl", ".f90", ".zig",
        ".nim", ".v", ".vhd", ".asm", ".s",
        # shells and scripts
        ".sh", ".bash", ".zsh", ".fish", ".ps1", ".bat", ".cmd",
        # configuration and data languages
        ".toml", ".yaml", ".yml", ".ini", ".cfg", ".conf", ".properties", ".xml", ".proto",
        ".graphql", ".cmake", ".mk", ".gradle", ".dockerfile", ".diff", ".patch",
        # web and markup
        ".html", ".htm", ".css", ".scss", ".sass", ".less", ".vue", ".svelte", ".sql", ".tex",
        ".bib",
    }
)  # fmt: skip
_PDF_SUFFIXES = frozenset({".pdf"})
_DOCX_SUFFIXES = frozenset({".docx", ".docm", ".dotx", ".dotm"})  # macro-enabled and templates too

SUPPORTED_SUFFIXES: frozenset[str] = (
    _TEXT_SUFFIXES | _MARKDOWN_SUFFIXES | _SOURCE_SUFFIXES | _PDF_SUFFIXES | _DOCX_SUFFIXES
)

# Well-known files that carry no suffix (compared case-insensitively).
_BARE_NAMES = {
    "makefile": "source",
    "gnumakefile": "source",
    "dockerfile": "source",
    "containerfile": "source",
    "readme": "text",
    "license": "text",
    "licence": "text",
    "copying": "text",
    "authors": "text",
    "changelog": "text",
    "notice": "text",
}

# Suffixes we know and refuse with a specific hint instead of the generic list.
_HINTS = {
    ".doc": "Open it in Word or LibreOffice and save it as .docx (or PDF), then drop that instead.",
    ".rtf": "Save it as .docx or plain text (.txt) and drop that instead.",
    ".odt": "Save it as .docx (File > Save As > Word) and drop that instead.",
    ".pages": "Export it as .docx or PDF and drop that instead.",
    ".xlsx": "Export the sheet as .csv and drop that instead.",
    ".xls": "Export the sheet as .csv and drop that instead.",
    ".pptx": "Export it as PDF and drop that instead.",
    ".ppt": "Export it as PDF and drop that instead.",
    ".epub": "Convert it to PDF or plain text first.",
}


def _kind_for(path: str | os.PathLike[str]) -> str | None:
    name = os.path.basename(os.fspath(path))
    suffix = os.path.splitext(name)[1].lower()
    if suffix in _PDF_SUFFIXES:
        return "pdf"
    if suffix in _DOCX_SUFFIXES:
        return "docx"
    if suffix in _MARKDOWN_SUFFIXES:
        return "markdown"
    if suffix in _SOURCE_SUFFIXES:
        return "source"
    if suffix in _TEXT_SUFFIXES:
        return "text"
    if not suffix:
        if name.startswith(".") and name not in (".", ".."):
            return "text"  # a dotfile (.bashrc, .gitignore, .editorconfig): configuration as text
        return _BARE_NAMES.get(name.lower())
    return None


def is_supported(path: str | os.PathLike[str]) -> bool:
    """True when ``load_document`` reads a file of this name: a supported suffix, or none (read by its content).

    A name is not the whole story: ``load_document`` also reads a file of another suffix whose content is a PDF, a
    Word file or text, and refuses a file whose content is none of these with a message that says what it is; so
    the app hands it every dropped file rather than filtering by name."""
    return _kind_for(path) is not None or not os.path.splitext(os.path.basename(os.fspath(path)))[1]


def _supported_summary() -> str:
    """One line a user can read: the kinds, a few examples of each, and how many source suffixes there are."""
    return (f"Supported: PDF (.pdf), Word (.docx), plain text and Markdown (.txt, .md, .csv, .json and "
            f"{len(_TEXT_SUFFIXES | _MARKDOWN_SUFFIXES) - 4} more) and source code (.py, .js, .c, .java and "
            f"{len(_SOURCE_SUFFIXES) - 4} more).")


# --------------------------------------------------------------------------------------------------
# Public types
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Document:
    """Text extracted from one file."""

    name: str  # file name shown to the model and UI (basename)
    path: str  # absolute path of the file read
    kind: str  # "text" | "markdown" | "source" | "pdf" | "docx" | "web" (a whole web page read as its text)
    text: str  # normalised text: "\n" line endings, no NULs, at most two blank lines in a row
    pages: int | None  # number of pages for a PDF; None otherwise
    chars: int  # len(text)
    notes: tuple[str, ...] = ()  # what the reader should know: bytes replaced, the encoding guessed


class DocumentError(EngineError, ValueError):
    """A file could not be turned into text; ``str(err)`` is a message the user can act on.

    ``reason`` is one of "missing", "unsupported", "binary", "encrypted", "too_large",
    "unreadable", "empty"; ``path`` is the path that was given.
    """

    REASONS = frozenset({"missing", "unsupported", "binary", "encrypted", "too_large", "unreadable", "empty"})

    def __init__(self, message: str, *, path: str, reason: str) -> None:
        if reason not in self.REASONS:
            raise ValueError(f"unknown DocumentError reason {reason!r}")
        super().__init__(message)
        self.path = path
        self.reason = reason

    def __reduce__(self):  # keep path/reason when pickled (e.g. across a process pool)
        return (_rebuild_error, (str(self), self.path, self.reason))


def _rebuild_error(message: str, path: str, reason: str) -> DocumentError:
    return DocumentError(message, path=path, reason=reason)


# --------------------------------------------------------------------------------------------------
# Helpers: sizes and normalisation
# --------------------------------------------------------------------------------------------------


def _size(n: int) -> str:
    if n < 1024:
        return f"{n:,} bytes"
    value = n / 1024
    unit = "KiB"
    for bigger in ("MiB", "GiB", "TiB"):
        if value < 1024:
            break
        value /= 1024
        unit = bigger
    return f"{value:,.1f} {unit} ({n:,} bytes)"


_BLANK_RUN = re.compile(r"\n(?:[ \t]*\n){3,}")
_LEADING_BLANK_LINES = re.compile(r"\A(?:[ \t]*\n)+")


# Terminal escape sequences (a log's colours, a cursor move, a window title): markup for a terminal, noise to a model
_TERMINAL_ESCAPES = re.compile(r"\x1b(?:\[[0-?]*[ -/]*[@-~]|\][^\x07\x1b]*(?:\x07|\x1b\\)|[@-Z\\-_])?")


# A UTF-16 surrogate alone is no character (a PDF's broken font map gives them, a decoder told to pass them): it
# cannot be encoded, so it could not be stored, tokenized or shown. U+FFFD shows where it was.
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def _normalise(text: str) -> str:
    text = _LONE_SURROGATE.sub("\ufffd", text.replace("\x00", ""))
    if "\x1b" in text:
        text = _TERMINAL_ESCAPES.sub("", text)
    if text.startswith("\ufeff"):
        text = text[1:]
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    text = _BLANK_RUN.sub("\n\n\n", text)  # at most two blank lines in a row
    text = _LEADING_BLANK_LINES.sub("", text)
    return text.rstrip()


def _reason_of(exc: BaseException) -> str:
    detail = str(exc).strip() or type(exc).__name__
    if len(detail) > 200:
        detail = detail[:197] + "..."
    return detail
