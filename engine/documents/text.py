"""Plain text, Markdown and source code: bytes to text, with the encoding found from a byte-order mark,
UTF-8, or (for legacy code pages) charset-normalizer, and binary files refused with a message that says so."""

from __future__ import annotations

import codecs
import threading

_SNIFF = 8192
# C0 controls that do not occur in text (tab, LF, VT, FF, CR and ESC do).
_CONTROL_BYTES = bytes(b for b in range(32) if b not in (9, 10, 11, 12, 13, 27)) + b"\x7f"
_CONTROL_CHARS = frozenset(chr(b) for b in _CONTROL_BYTES)
_CONTROL_TRANSLATE = bytes.maketrans(_CONTROL_BYTES, b"\x00" * len(_CONTROL_BYTES))

_BOMS = (
    (b"\x00\x00\xfe\xff", "utf-32-be", 4),
    (b"\xff\xfe\x00\x00", "utf-32-le", 4),  # must precede the UTF-16 LE BOM it starts with
    (b"\xef\xbb\xbf", "utf-8", 3),
    (b"\xfe\xff", "utf-16-be", 2),
    (b"\xff\xfe", "utf-16-le", 2),
)


def _control_ratio_bytes(head: bytes) -> float:
    if not head:
        return 0.0
    return head.translate(_CONTROL_TRANSLATE).count(0) / len(head)


def _control_ratio_chars(head: str) -> float:
    if not head:
        return 0.0
    return sum(ch in _CONTROL_CHARS for ch in head) / len(head)


def _decode_text(data: bytes, label: str, fail, notes: list[str]) -> str:
    not_text = (
        f"{label} doesn't look like a text file (it contains binary data). "
        "If it is text in another encoding, save it as UTF-8 and drop it again."
    )

    # 1. A byte-order mark says exactly how to decode.
    for bom, encoding, width in _BOMS:
        if data.startswith(bom):
            body = data[width:]
            try:
                text = body.decode(encoding)
            except UnicodeDecodeError:
                text = body.decode(encoding, errors="replace")
                bad = text.count("\ufffd")
                if bad > max(1, len(text) // 1000):
                    raise fail("binary", not_text) from None
                notes.append(_replaced_note(bad, encoding.upper()))
            if _control_ratio_chars(text[:_SNIFF]) > 0.05:
                raise fail("binary", not_text)
            return text

    # 2. No BOM: the first 8 KiB decide whether this is text at all.
    head = data[:_SNIFF]
    if b"\x00" in head:
        raise fail(
            "binary",
            f"{label} doesn't look like a text file (it contains NUL bytes). "
            "If it is UTF-16 text without a byte-order mark, save it as UTF-8 and drop it again.",
        )
    if _control_ratio_bytes(head) > 0.05:
        raise fail("binary", not_text)

    # 3. UTF-8, the overwhelmingly common case (Chinese included).
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        pass

    # 4. UTF-8 with some invalid bytes (a pasted Windows-1252 quote, a file joined from two encodings, a damaged
    #    download): valid multi-byte characters say it is UTF-8, whose characters a legacy code page would turn
    #    into mojibake ("café" -> "cafÃ©"). A lone invalid byte between valid text is read as the Windows-1252
    #    character it is there ("naïve" saved by another editor); runs of invalid bytes are replaced. Both are said.
    #    Legacy double-byte text (GB18030, Shift-JIS) holds byte pairs that happen to be valid UTF-8, but its
    #    invalid bytes come in runs, and it has more of them than valid characters: it goes on to 5.
    mended, as_cp1252, replaced = _decode_mixed(data)
    # characters past ASCII that were valid UTF-8 (neither a Windows-1252 byte read here nor U+FFFD)
    valid = sum(1 for ch in mended if ord(ch) > 127) - as_cp1252 - mended.count("\ufffd")
    if valid > 0 and (valid >= as_cp1252 + replaced or not replaced):
        if as_cp1252:
            notes.append(f"{as_cp1252} byte{'s' if as_cp1252 != 1 else ''} not valid UTF-8, read as Windows-1252")
        if replaced:
            notes.append(_replaced_note(replaced, "UTF-8"))
        return mended

    # 5. A legacy encoding: a maintained detector (charset-normalizer) decides; never UTF-16/32 without a BOM.
    guess = _detect_legacy(data)
    if guess is not None:
        encoding, text = guess
        notes.append(f"not UTF-8: read as {encoding}")
        return text

    # 6. Nothing credible: Windows-1252 for bytes that look like text (few high bytes), else refuse.
    high = sum(1 for b in head if b >= 0x80)
    if high / max(1, len(head)) > 0.3:
        raise fail(
            "binary",
            f"{label} is not UTF-8 and its encoding could not be recognised. "
            "Save it as UTF-8 and drop it again.",
        )
    notes.append("not UTF-8: read as Windows-1252")
    try:
        return data.decode("cp1252")
    except UnicodeDecodeError:
        return data.decode("latin-1")


def _decode_mixed(data: bytes) -> tuple[str, int, int]:
    """UTF-8 `data` with invalid bytes: (text, bytes read as Windows-1252, bytes replaced with U+FFFD)."""
    _MIXED_COUNTS.cp1252 = _MIXED_COUNTS.replaced = 0
    text = data.decode("utf-8", errors=_MIXED_ERRORS)
    return text, _MIXED_COUNTS.cp1252, _MIXED_COUNTS.replaced


def _mend_invalid(error: UnicodeDecodeError) -> tuple[str, int]:
    """The decode error handler of `_decode_mixed`: a lone invalid byte between valid text is its Windows-1252
    character; anything else is U+FFFD a byte."""
    data, bad_at, bad_end = error.object, error.start, error.end
    lone = (bad_end - bad_at == 1 and (bad_at == 0 or data[bad_at - 1] < 0x80)
            and (bad_end == len(data) or data[bad_end] < 0x80))
    char = _cp1252_char(data[bad_at]) if lone else None
    if char is None:
        _MIXED_COUNTS.replaced += bad_end - bad_at
        return "\ufffd" * (bad_end - bad_at), bad_end
    _MIXED_COUNTS.cp1252 += 1
    return char, bad_end


_MIXED_ERRORS = "dsv41-mixed-utf8"
_MIXED_COUNTS = threading.local()  # the handler's counts, per thread (documents load on workers)
codecs.register_error(_MIXED_ERRORS, _mend_invalid)


def _cp1252_char(byte: int) -> str | None:
    """The Windows-1252 letter or punctuation mark `byte` stands for, or None (undefined, or a control)."""
    try:
        char = bytes([byte]).decode("cp1252")
    except UnicodeDecodeError:
        return None
    return None if char == "\xa0" or not char.isprintable() else char


def _replaced_note(count: int, encoding: str) -> str:
    return f"{count} byte{'s' if count != 1 else ''} not valid {encoding}, replaced with \ufffd"


_WIDE_ENCODINGS = ("utf_16", "utf_16_be", "utf_16_le", "utf_32", "utf_32_be", "utf_32_le", "utf_7")


def _detect_legacy(data: bytes) -> tuple[str, str] | None:
    """(encoding, text) by charset-normalizer, or None when it finds nothing credible."""
    try:
        from charset_normalizer import from_bytes
    except ImportError:  # pragma: no cover - a declared dependency
        return None
    matches = list(from_bytes(data, cp_exclusion=list(_WIDE_ENCODINGS)))
    if not matches:
        return None
    best = matches[0]
    # Code pages that decode a text equally well tie; the detector then names any of them (Central European
    # cp1250 for mostly-English text with a few accents, say). Ties go to the code page most text is in.
    tied = [m for m in matches if m.chaos == best.chaos and m.coherence == best.coherence]
    for common in _COMMON_CODE_PAGES:
        found = next((m for m in tied if common in m.could_be_from_charset), None)
        if found is not None:
            best, encoding = found, common
            break
    else:
        encoding = best.encoding
    if encoding.startswith("utf"):
        return None
    text = data.decode(encoding, errors="replace")
    if len(data) < 64 and encoding != "cp1252" and (best.chaos > 0 or _mostly_latin(text)):
        # too little text to tell one Latin code page from another ("crème" reads as Central European "crčme"
        # just as well): Windows-1252 below. A short text in another script (a Chinese CSV, a Russian line)
        # that decodes without a flaw is what it seems.
        return None
    return _code_page_name(encoding), text


def _mostly_latin(text: str) -> bool:
    """Whether most of the letters past ASCII in `text` are Latin ones (or there are none)."""
    import unicodedata

    letters = [ch for ch in text if ord(ch) > 127 and ch.isalpha()]
    latin = sum(1 for ch in letters if unicodedata.name(ch, "").startswith("LATIN"))
    return not letters or latin * 2 > len(letters)


def _code_page_name(encoding: str) -> str:
    """'cp1251' -> 'Windows-1251' (as the Windows-1252 fallback is named), else the codec's name."""
    return f"Windows-{encoding[2:]}" if encoding.startswith("cp125") else encoding.replace("_", "-")


# By how much text is written in them (Windows-1252 first), for ties between equally good code pages.
_COMMON_CODE_PAGES = ("cp1252", "gb18030", "big5", "cp932", "shift_jis", "cp949", "euc_kr", "cp1251", "cp1250",
                      "cp1253", "cp1254", "cp1255", "cp1256", "cp1257", "cp1258", "koi8_r", "latin_1")

