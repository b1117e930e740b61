"""Typed events a turn streams out. One type per kind; the CLI, the GUI worker and the tests share them."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class PrefillProgress:
    done: int  # prompt tokens read so far in this turn
    total: int


@dataclass(frozen=True)
class TokenText:
    text: str  # never splits a UTF-8 character; may be "" for tokens that complete nothing yet
    token_id: int


@dataclass(frozen=True)
class TurnStats:
    ttft_s: float  # turn start -> first token shown (includes prefill)
    prefill_tokens: int
    prefill_tok_s: float
    decode_tokens: int
    decode_tok_s: float
    total_s: float
    tokens_seen: int = 0
    kv_stored_tokens: int = 0
    kv_stored_bytes: int = 0
    kv_uncompressed_bytes: int = 0
    compaction_s: float = 0.0
    csa2_recall: float | None = None
    rebuilt_context: bool = False  # the cache was rebuilt from the transcript (template did not extend)
    restored_context: bool = False  # the conversation's saved cache was restored instead (engine.conversation_store)
    recall_s: float = 0.0  # time the question spent recalling from the cold tier
    recalled_entries: int = 0  # entries it brought back (per head, summed over layers)
    prompt_tokens: int = 0  # the whole prompt the reply follows: kept in the cache from before, plus prefill_tokens

    @property
    def compression_ratio(self) -> float:
        return self.kv_stored_bytes / self.kv_uncompressed_bytes if self.kv_uncompressed_bytes else 1.0


@dataclass(frozen=True)
class ErrorEvent:
    message: str
    kind: str = "error"  # "oom" | "error"


@dataclass(frozen=True)
class Done:
    reason: str  # "eos" | "stop" | "length" | "context_full" | "cancelled" | "error"
    text: str
    stats: TurnStats | None = None
    token_ids: tuple[int, ...] = field(default=())



@dataclass(frozen=True)
class ContextUsage:
    """Token counts per part, for the GUI's context bar."""

    system: int
    history: int
    documents: int
    prompt: int
    limit: int
    estimated: bool = False  # counted from characters (a remote server that counts nothing for us)

    @property
    def total(self) -> int:
        return self.system + self.history + self.documents + self.prompt

    @property
    def fits(self) -> bool:
        return self.total < self.limit


Event = PrefillProgress | TokenText | TurnStats | ErrorEvent | Done
