"""What the cache holds of a document now, and the parts of it a user keeps hot.

Heat: for each token of an attached document's text, the share of the cache's (layer, KV head) slots that hold its
entry in the hot set (attended to at every step; on the GPU where there is one). What is not hot sits in the cold tier (RAM or
disk; a question brings back what it needs) or, with the tier off, was discarded.

Pins: pieces of a document's text the user keeps hot (ChatSession.set_pins). Each is found in the last document
block of the conversation that holds it, mapped to the positions of the tokens covering it, and those positions
rank first in every compaction (DSV41Cache.pin), within half the hot set. They are looked for again after every
turn: a rebuild or an edit moves positions, and a piece not found yet may be in a document sent later.

The app tints the document's text with it (the document text window), so a user sees which parts the last question
kept hot and what a ratio slider changed. The document is found in the conversation by its tokens: its text is
tokenized alone, with each token's characters, and located in the transcript the cache holds (the block's first and
last tokens may have merged with the text around them; the rest is the same sequence).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from types import SimpleNamespace

from . import chat_template as template
from .documents import BLOCK_CLOSING, BLOCK_OPENING, CLOSING_TAG, defuse
from .errors import EngineError

log = logging.getLogger(__name__)

ANCHOR = 24  # tokens of the document's text that locate it in the transcript
MIN_MATCH = 0.95  # share of its tokens that must equal the transcript's where it was found


@dataclass(frozen=True)
class DocumentHeat:
    """`spans`: (start, end, share) for each token of the document: its characters in the document's text and the
    share of the cache's (layer, KV head) slots that hold it hot, 0..1."""

    spans: tuple[tuple[int, int, float], ...]
    hot_share: float  # over the document's tokens
    tokens: int
    first_position: int  # the cache position (transcript index) of the document's first token
    cold_tier: str  # "ram" | "disk" | "off": where what is not hot is
    ratio: float  # the cache ratio the hot set is held to

    def to_dict(self) -> dict:
        """As JSON (our server's POST /v1/dsv41/heat): the spans as [start, end, share] lists."""
        return {"spans": [list(s) for s in self.spans], "hot_share": self.hot_share, "tokens": self.tokens,
                "first_position": self.first_position, "cold_tier": self.cold_tier, "ratio": self.ratio}

    @classmethod
    def from_dict(cls, data: dict) -> DocumentHeat:
        """to_dict's inverse; ValueError for anything else (a server's answer is checked, not trusted)."""
        try:
            spans = tuple((int(a), int(b), float(c)) for a, b, c in data["spans"])
            heat = cls(spans, float(data["hot_share"]), int(data["tokens"]), int(data["first_position"]),
                       str(data["cold_tier"]), float(data["ratio"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"not a document's heat: {exc}") from exc
        if heat.tokens != len(spans) or any(not 0.0 <= c <= 1.0 or a > b for a, b, c in spans):
            raise ValueError("not a document's heat: its spans and figures disagree")
        return heat

    def levels(self, edges: tuple[float, ...] = (0.1, 0.5, 0.9)) -> list[tuple[int, int, int]]:
        """Runs of adjacent tokens at one level (0: below edges[0] … len(edges)), merged: (start, end, level)."""
        runs: list[tuple[int, int, int]] = []
        for start, end, share in self.spans:
            level = sum(share >= e for e in edges)
            if runs and runs[-1][2] == level and start <= runs[-1][1] + 1:
                runs[-1] = (runs[-1][0], max(end, runs[-1][1]), level)
            else:
                runs.append((start, end, level))
        return runs


    def profile(self, length: int, width: int) -> list[float]:
        """The document at a glance in `width` parts of its text (`length` characters in all): each the mean hot
        share of the tokens starting in it (a part where none starts takes the one before; 0 before any)."""
        sums, counts = [0.0] * width, [0] * width
        for start, _end, share in self.spans:
            part = min(start * width // max(length, 1), width - 1)
            sums[part] += share
            counts[part] += 1
        out, last = [], 0.0
        for total, count in zip(sums, counts, strict=True):
            if count:
                last = total / count
            out.append(last)
        return out

    def strip(self, length: int, width: int = 60) -> str:
        """The profile in `width` characters (the terminal's tint), from ' ' (cold) to '█'."""
        top = len(_BLOCKS) - 1
        return "".join(_BLOCKS[min(round(share * top), top)] for share in self.profile(length, width))

    def summary(self) -> str:
        """'42 % of its 1,704 tokens hot (cache ratio 0.50); the rest in the cold tier in RAM'."""
        rest = {"ram": "the rest in the cold tier in RAM", "disk": "the rest in the cold tier on disk",
                "off": "the rest discarded (cold tier off)"}.get(self.cold_tier, "")
        return f"{self.hot_share:.0%} of its {self.tokens:,} tokens hot (cache ratio {self.ratio:.2f}); {rest}"


_BLOCKS = " ▁▂▃▄▅▆▇█"


def hot_share(cache):
    """Per position the cache has seen, the share of its (layer, KV head) slots that hold that position's entry in
    the hot set (a float32 tensor on the CPU). Torch is imported here: the GUI imports this module's types."""
    import torch

    seen = cache.seen
    counts = torch.zeros(seen, dtype=torch.float64)
    for layer in cache.layers:
        at = layer.positions[:, :layer.length].reshape(-1).to("cpu", torch.int64)
        at = at[(at >= 0) & (at < seen)]
        counts += torch.bincount(at, minlength=seen)[:seen].to(torch.float64)
    return (counts / (len(cache.layers) * cache.kv_heads)).to(torch.float32)


def document_heat(session, text: str) -> DocumentHeat | None:
    """The hot share of each token of `text`, a document the chat `session` has read (its last copy in the
    conversation); None when the chat's cache does not hold it (not sent yet, the cache being rebuilt, or a
    tokenizer that cannot say which characters a token covers)."""
    if not text or not _readable(session):
        return None
    body, shift = _as_read(text)
    found = _find(session, body)
    if found is None:
        return None
    start, offsets = found
    n = min(len(offsets), len(session.transcript_ids) - start)
    share = hot_share(session.cache)[start:start + n].tolist()
    spans = tuple((shift(offsets[j][0]), shift(offsets[j][1]), share[j]) for j in range(n))
    settings = session.cache.settings
    return DocumentHeat(spans, sum(share) / n if n else 0.0, n, start, settings.cold_tier, settings.kv_cache_ratio)


def _readable(session) -> bool:
    """The chat's cache holds exactly its transcript's tokens, and its tokenizer says which characters each covers."""
    return (getattr(session.tokenizer, "is_fast", False) and not session._dirty
            and session.cache.seen == len(session.transcript_ids))


def _find(session, body: str, found: dict | None = None) -> tuple[int, list] | None:
    """Where a document's text `body` (as its block holds it) sits in the chat's transcript: the position of its first
    token and each token's (start, end) characters in `body`; None where it is not there. `found` keeps the answer
    per body across calls (one tokenization of a document for all the pins in it)."""
    if found is not None and body in found:
        return found[body]
    encoded = session.tokenizer(body, add_special_tokens=False, split_special_tokens=True,
                                return_offsets_mapping=True)
    start = _locate(session.transcript_ids, list(encoded["input_ids"]))
    result = None if start is None else (start, list(encoded["offset_mapping"]))
    if found is not None:
        found[body] = result
    return result


def _as_read(text: str):
    """The document's text as its block holds it (engine.documents.format_for_prompt: a closing tag inside it is
    defused with one character more), and a map from that text's offsets back to `text`'s."""
    body = template.clean_text(text)
    inserted = [m.start() + 1 + i for i, m in enumerate(CLOSING_TAG.finditer(body))]  # where "\\" went in
    body = defuse(body)
    if len(body) - len(inserted) != len(text):  # clean_text changed the length: map what can be mapped
        inserted = []

    def shift(offset: int) -> int:
        return min(offset - sum(1 for i in inserted if i < offset), len(text))

    return body, shift


def _locate(ids: list[int], doc_ids: list[int]) -> int | None:
    """Where `doc_ids` begins in `ids` (its last copy), allowing its first and last tokens to differ; None when it
    is not there. A repetitive text matches itself shifted by its period nearly everywhere: the place that agrees
    best wins (the last of equals), so a document sent twice is found at its second copy, not one period late."""
    import numpy as np

    n = len(doc_ids)
    if n == 0 or n > len(ids) + 2:
        return None
    skip = 2 if n > ANCHOR + 8 else 1 if n > 4 else 0  # the first tokens may have merged with what comes before
    seq, doc = np.asarray(ids, dtype=np.int64), np.asarray(doc_ids, dtype=np.int64)
    anchor = doc[skip:skip + min(ANCHOR, n - 2 * skip)]
    best, agreed = None, -1
    for i in np.flatnonzero(seq[: len(seq) - len(anchor) + 1] == anchor[0])[::-1].tolist():
        start = i - skip
        if start < 0 or not np.array_equal(seq[i:i + len(anchor)], anchor):
            continue
        window = seq[start:start + n]
        if len(window) < n - 2:
            continue
        same = int(np.count_nonzero(window == doc[: len(window)]))
        if same > agreed:
            best, agreed = start, same
        if same >= n - 2:  # as close as a real copy comes (its edge tokens may have merged)
            break
    return best if best is not None and agreed >= min(MIN_MATCH * n, n - 2) else None


def pin_range(session, snippet: str, found: dict | None = None) -> tuple[int, int] | None:
    """The cache positions (start, end) of the tokens covering `snippet`, a piece of a document the chat has read
    (its last copy in the conversation), or None where no document it read holds it. `found`: as _find's."""
    snippet = defuse(template.clean_text(snippet))  # as the block holds it (a closing tag in it defused)
    fed = session.fed_text
    if not snippet.strip():
        return None
    before = len(fed)
    while True:  # the document blocks from the last: the first whose text holds the snippet (a question or a reply
        opening = fed.rfind(BLOCK_OPENING, 0, before)  # quoting it does not count)
        if opening < 0:
            return None
        body_start = fed.find("\n", opening) + 1
        body_end = fed.find(BLOCK_CLOSING, body_start)
        at = fed.rfind(snippet, body_start, body_end) if 0 < body_start <= body_end else -1
        if at >= 0:
            break
        before = opening
    located = _find(session, fed[body_start:body_end], found)
    if located is None:
        return None
    start, offsets = located
    low, high = at - body_start, at - body_start + len(snippet)
    covering = [j for j, (a, b) in enumerate(offsets) if a < high and b > low]
    if not covering:
        return None
    return start + covering[0], min(start + covering[-1] + 1, len(session.transcript_ids))


def set_pins(session, texts) -> tuple[str, ...]:
    """ChatSession.set_pins: `texts` become the chat's pins (empty ones dropped), or, past the cache's room for
    them (PinError), the pins stay as they were."""
    previous, session.pins = session.pins, [t for t in texts if t and t.strip()]
    try:
        return apply_pins(session)
    except Exception:
        session.pins = previous
        raise


def keep_pins(session) -> None:
    """After a turn: the pins hot again where a rebuild dropped them, and found in a document sent since; never fails
    the turn (more than a tighter ratio has room for: the cache keeps the pins it had)."""
    try:
        apply_pins(session)
    except EngineError as exc:
        log.warning("pinned parts not kept: %s", exc)


def pins_ahead(session, turn) -> None:
    """Before a turn reads its tokens: the pins kept hot from its first token on. A chat restored from a saved
    state (reopened, regenerated, edited) has them applied now (what of them had gone cold comes back); where the
    turn reads a document or the whole conversation again, the pins found in the transcript it is about to hold rank
    first in the compactions while it reads (those that fit the room the cache will have at its end). keep_pins
    applies them again once the turn is over."""
    if not session.pins:
        return
    if turn.restored and not turn.rebuild:
        keep_pins(session)
    if not (turn.rebuild or turn.restored or BLOCK_OPENING in turn.delta_text):
        return  # (a state restored inside a turn holds the document but for the piece read with the question)
    ahead = SimpleNamespace(fed_text=session.fed_text + turn.delta_text, tokenizer=session.tokenizer,
                            transcript_ids=list(session.transcript_ids) + list(turn.new_ids))
    found: dict = {}
    ranges = [r for r in (pin_range(ahead, text, found) for text in session.pins) if r is not None]
    cache = session.cache
    room = cache.pin_room(len(ahead.transcript_ids))  # the room the cache will have once the turn is read
    kept: list[tuple[int, int]] = []
    for where in dict.fromkeys(ranges):
        if sum(end - start for start, end in [*kept, where]) <= room:
            kept.append(where)
    cache.pinned = tuple(kept)


def apply_pins(session) -> tuple[str, ...]:
    """Each of session.pins found in the documents the chat read and kept hot by the cache (DSV41Cache.pin); the
    pins not found, in order."""
    ranges, missing, found = [], [], {}
    readable = _readable(session)
    for text in session.pins:
        where = pin_range(session, text, found) if readable else None
        if where is None:
            missing.append(text)
        else:
            ranges.append(where)
    session.cache.pin(ranges)
    return tuple(missing)
