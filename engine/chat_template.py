"""The chat template as data and control: only the template's own markers become special tokens.

Text from the user, a document, the system prompt or an earlier reply is data. A `<|im_start|>` typed or
pasted into it, or inside a dropped file, must tokenize into ordinary pieces, never into the control token
(otherwise a document can open a fake system turn: prompt injection).

How: every special-token string inside a message's content is swapped for a placeholder before the
template renders (so the template's own logic, filters included, runs on the real text), the special
strings left in the rendered text are the template's own, and the placeholders are put back as plain text.
`Rendered` keeps the text and where the template's control tokens are; `encode` turns any span of it into
token ids: control tokens by id, everything else with special-token parsing off.
"""

from __future__ import annotations

import re
import secrets
from dataclasses import dataclass
from functools import lru_cache


@dataclass(frozen=True)
class Rendered:
    """A rendered conversation: `text`, and the spans (start, end, token id) of the template's control tokens."""

    text: str
    specials: tuple[tuple[int, int, int], ...] = ()

    def specials_before(self, offset: int) -> tuple[tuple[int, int, int], ...]:
        return tuple(s for s in self.specials if s[0] < offset)

    def extends(self, text: str, specials: tuple[tuple[int, int, int], ...]) -> bool:
        """True when this rendering starts with `text` and has the same control tokens inside it."""
        return self.text.startswith(text) and self.specials_before(len(text)) == tuple(specials)


def special_tokens(tokenizer) -> dict[str, int]:
    """Every token the tokenizer parses as a control token: its string -> id."""
    return dict(_special_table(tokenizer))


def special_ids(tokenizer) -> frozenset[int]:
    return frozenset(i for _, i in _special_table(tokenizer))


def _special_table(tokenizer) -> tuple[tuple[str, int], ...]:
    key = id(tokenizer)
    cached = _TABLES.get(key)
    if cached is not None and cached[0] is tokenizer:
        return cached[1]
    table: dict[str, int] = {}
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    for token_id, token in decoder.items():
        if getattr(token, "special", False) and getattr(token, "content", ""):
            table[token.content] = int(token_id)
    for text in getattr(tokenizer, "all_special_tokens", ()) or ():
        token_id = tokenizer.convert_tokens_to_ids(text)
        if text and isinstance(token_id, int) and token_id >= 0 and token_id != tokenizer.unk_token_id:
            table.setdefault(text, token_id)
    result = tuple(sorted(table.items(), key=lambda kv: (-len(kv[0]), kv[0])))
    _TABLES[key] = (tokenizer, result)
    return result


_TABLES: dict[int, tuple[object, tuple[tuple[str, int], ...]]] = {}


@lru_cache(maxsize=16)
def _pattern(strings: tuple[str, ...]) -> re.Pattern | None:
    return re.compile("|".join(re.escape(s) for s in strings)) if strings else None


def clean_text(text: str) -> str:
    """`text` as valid Unicode: lone surrogates (bytes that were not UTF-8, smuggled through argv or a
    terminal as surrogate escapes, or a broken string from the API) become U+FFFD. Tokenizers refuse them."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        pass
    try:  # surrogate escapes of undecodable bytes (argv, stdin): decode those bytes, replacing what is not UTF-8
        return text.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
    except UnicodeEncodeError:  # other lone surrogates: pairs are joined, the rest replaced
        return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")


def replaced_count(text: str) -> int:
    """How many characters clean_text replaces in `text` (0 when it is valid)."""
    cleaned = clean_text(text)
    return 0 if cleaned is text else cleaned.count(REPLACEMENT) - text.count(REPLACEMENT)


REPLACEMENT = "\ufffd"


def encode_text(tokenizer, text: str) -> list[int]:
    """Token ids of `text` as plain data: special-token strings in it become ordinary pieces."""
    if not text:
        return []
    return list(tokenizer(clean_text(text), add_special_tokens=False, split_special_tokens=True)["input_ids"])


def count_text(tokenizer, text: str) -> int:
    return len(encode_text(tokenizer, text))


def render(tokenizer, messages: list[dict], add_generation_prompt: bool) -> Rendered:
    """Render `messages` with the tokenizer's chat template; message contents are data."""
    if not messages:
        return Rendered("")
    table = _special_table(tokenizer)
    pattern = _pattern(tuple(s for s, _ in table))
    ids = dict(table)
    nonce = secrets.token_hex(8)
    swapped: list[str] = []

    def hide(match: re.Match) -> str:
        swapped.append(match.group(0))
        return f"\ue000{nonce}:{len(swapped) - 1}\ue001"

    safe = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, str):
            content = clean_text(content)
            message = {**message, "content": pattern.sub(hide, content) if pattern is not None else content}
        safe.append(message)
    rendered = tokenizer.apply_chat_template(safe, tokenize=False, add_generation_prompt=add_generation_prompt)
    placeholder = re.compile(rf"\ue000{nonce}:(\d+)\ue001")
    scanner = re.compile("|".join([placeholder.pattern] + ([pattern.pattern] if pattern is not None else [])))
    out: list[str] = []
    specials: list[tuple[int, int, int]] = []
    length = 0
    last = 0
    for match in scanner.finditer(rendered):
        piece = rendered[last:match.start()]
        out.append(piece)
        length += len(piece)
        if match.group(1) is not None:  # a special string from a message: put back as plain text
            text = swapped[int(match.group(1))]
        else:  # the template's own control token
            text = match.group(0)
            specials.append((length, length + len(text), ids[text]))
        out.append(text)
        length += len(text)
        last = match.end()
    out.append(rendered[last:])
    return Rendered("".join(out), tuple(specials))


def count_system(tokenizer, system_prompt: str | None) -> int:
    """Tokens a conversation starts with before its first user turn, template markers included: the system
    prompt's, or without one whatever the template puts there by itself (a default system prompt; 0 if none)."""
    if system_prompt:
        return len(encode(tokenizer, render(tokenizer, [{"role": "system", "content": system_prompt}], False)))
    user = [{"role": "user", "content": "x"}]
    system = [{"role": "system", "content": "x"}]
    try:  # the user turn's own tokens, measured after a system turn of ours; the rest of a chat with it alone
        user_turn = (len(encode(tokenizer, render(tokenizer, system + user, False)))
                     - len(encode(tokenizer, render(tokenizer, system, False))))
        return max(len(encode(tokenizer, render(tokenizer, user, False))) - user_turn, 0)
    except Exception:  # noqa: BLE001 - a template without system turns adds none by itself either
        return 0


def encode(tokenizer, rendered: Rendered, start: int = 0, end: int | None = None) -> list[int]:
    """Token ids of rendered.text[start:end]: the template's control tokens by id, the rest as plain data."""
    end = len(rendered.text) if end is None else end
    ids: list[int] = []
    cursor = start
    for s, e, token_id in rendered.specials:
        if e <= start or s >= end:
            continue
        if s < start or e > end:  # a span cut through a control token: its visible part is plain text
            continue
        ids += encode_text(tokenizer, rendered.text[cursor:s])
        ids.append(token_id)
        cursor = e
    ids += encode_text(tokenizer, rendered.text[cursor:end])
    return ids


def decode_fed(tokenizer, token_ids: list[int], offset: int) -> tuple[str, tuple[tuple[int, int, int], ...]]:
    """Text of generated ids fed to the model (control tokens kept as text) and the spans of those control
    tokens, positioned after `offset` characters of earlier text."""
    specials = special_ids(tokenizer)
    text = ""
    spans = []
    run: list[int] = []

    def flush():
        nonlocal text
        if run:
            text += tokenizer.decode(run, skip_special_tokens=False, clean_up_tokenization_spaces=False)
            run.clear()

    for token_id in token_ids:
        if token_id in specials:
            flush()
            piece = tokenizer.decode([token_id], skip_special_tokens=False)
            spans.append((offset + len(text), offset + len(text) + len(piece), token_id))
            text += piece
        else:
            run.append(token_id)
    flush()
    return text, tuple(spans)


def reply_tokens_kept(tokenizer, token_ids: list[int], reply: str, most: int = 8) -> int:
    """How many of a reply's fed tokens to keep so that their text begins `reply`, the reply as the conversation keeps
    it (cut before a stop string; a character whose last bytes were never fed left out): all where it already does,
    else the most that do, giving up at most `most` from the end; all where none does (the next turn re-reads)."""
    for keep in range(len(token_ids), max(len(token_ids) - most, 0) - 1, -1):
        if reply.startswith(decode_fed(tokenizer, token_ids[:keep], 0)[0]):
            return keep
    return len(token_ids)
