"""The life of one turn on the GUI side: rows in the store, bubbles in the view, the request to the worker.

A turn starts with a user row and an empty reply row ("streaming"); text batches from the worker are
painted at once and saved at most every SAVE_EVERY_S; the outcome closes the row with its figures.
A turn the engine refused before starting (context overflow, unreadable document, no model) is
rolled back: the rows go, and the text and documents go back into the composer. So is a turn stopped before its
reply began (while its message or documents were read): the engine keeps nothing of it, so a chat that showed it
would show a question, and documents, the model never read.
"""

from __future__ import annotations

import dataclasses
import itertools
import sqlite3
import time
from dataclasses import dataclass, field

from PySide6.QtCore import QObject, Signal

from . import store as S
from .protocol import AttachedDocument, GenerationOptions, HistoryTurn, TurnOutcome, TurnRequest
from .widgets.chat_view import ChatView, MessageBubble

SAVE_EVERY_S = 0.5
FINISHED = {"eos": S.DONE, "stop": S.DONE, "length": S.DONE, "context_full": S.DONE, "cancelled": S.STOPPED,
            "error": S.ERROR}

_turn_ids = itertools.count(1)


@dataclass
class ActiveTurn:
    request: TurnRequest
    conversation_id: int
    user_id: int
    reply_id: int
    prompt: str
    documents: tuple[AttachedDocument, ...]
    bubble: MessageBubble | None
    text: str = ""
    stats: object | None = None
    last_save: float = field(default_factory=time.monotonic)
    stopping: bool = False
    save_failed: bool = False  # a write of this reply failed (said once)
    new_version: bool = False  # a regenerated reply: the earlier ones stay as its versions


class TurnController(QObject):
    started = Signal()
    finished = Signal(object, object)  # TurnOutcome, ActiveTurn
    refused = Signal(object, object)  # TurnOutcome, ActiveTurn (rows already rolled back)
    withdrawn = Signal(object, object)  # TurnOutcome, ActiveTurn: stopped before its reply began (rolled back)
    save_failed = Signal(str)  # a reply could not be saved (disk full): the message

    def __init__(self, store: S.ConversationStore, client, view: ChatView, parent: QObject | None = None):
        super().__init__(parent)
        self.store, self.client, self.view = store, client, view
        self.active: ActiveTurn | None = None
        worker = client.worker
        worker.prefill_progress.connect(self._on_prefill)
        worker.tokens.connect(self._on_tokens)
        worker.stats.connect(self._on_stats)
        worker.turn_finished.connect(self._on_finished)

    @property
    def busy(self) -> bool:
        return self.active is not None

    # ------------------------------------------------------------------ starting
    def start(self, conversation_id: int, prompt: str, documents: tuple[AttachedDocument, ...],
              doc_tokens: dict[str, int], generation: GenerationOptions, settings: dict,
              history: tuple[HistoryTurn, ...], *, replace_from: int | None = None,
              system_prompt: str = "", version_of: int | None = None, pins: tuple[str, ...] = ()) -> ActiveTurn:
        """Save the user's message (raises sqlite3.Error / StoreUnavailable, with nothing changed, when it
        cannot be saved), show it, and send the turn to the engine. `version_of`: the user message (already
        saved) whose reply is made again; the earlier replies stay as versions."""
        if version_of is not None:
            user_id, reply_id = version_of, self.store.add_version(conversation_id, version_of, settings)
        else:
            user_id, reply_id = self.store.add_turn(conversation_id, prompt,
                                                    [(d, doc_tokens.get(d.key)) for d in documents], settings,
                                                    replace_from=replace_from)
            user = self.store.message(user_id)
            self.view.add(MessageBubble("user", prompt, message_id=user_id, attachments=user.attachments))
        bubble = self.view.add(MessageBubble("assistant", "", message_id=reply_id))
        bubble.set_progress("Waiting for the engine…")
        request = TurnRequest(next(_turn_ids), conversation_id, history, prompt, documents, generation,
                              system_prompt=system_prompt, pins=pins)
        self.active = ActiveTurn(request, conversation_id, user_id, reply_id, prompt, documents, bubble,
                                 new_version=version_of is not None)
        self.client.send_turn(request)
        self.started.emit()
        return self.active

    def stop(self) -> None:
        if self.active is not None:
            self.active.stopping = True
            self.client.stop()
            if self.active.bubble is not None:
                self.active.bubble.set_progress("Stopping…" if not self.active.text else "")

    def rebind(self, bubbles: list[MessageBubble]) -> None:
        """The view was rebuilt (conversation switched): find the streaming reply's bubble again."""
        if self.active is None:
            return
        self.save_now()
        self.active.bubble = next((b for b in bubbles if b.message_id == self.active.reply_id), None)

    def save_now(self) -> None:
        if self.active is not None:
            self._write(self.store.update_reply, self.active.reply_id, self.active.text)
            self.active.last_save = time.monotonic()

    def _write(self, write, *args, **kwargs) -> bool:
        """A store write during a turn; a failure (disk full) is said once per turn, and the reply stays on
        screen (the next write retries)."""
        try:
            write(*args, **kwargs)
            return True
        except (sqlite3.Error, S.StoreUnavailable) as exc:
            if self.active is None or not self.active.save_failed:
                if self.active is not None:
                    self.active.save_failed = True
                self.save_failed.emit(str(exc))
            return False

    # ------------------------------------------------------------------ streaming
    def _current(self, turn_id: int) -> ActiveTurn | None:
        turn = self.active
        return turn if turn is not None and turn.request.turn_id == turn_id else None

    def _on_prefill(self, turn_id: int, done: int, total: int) -> None:
        turn = self._current(turn_id)
        if turn is not None and turn.bubble is not None and not turn.text and not turn.stopping:
            turn.bubble.set_progress(f"Reading the prompt: {done:,} / {total:,} tokens…" if done < total
                                     else f"Read {total:,} tokens; thinking…")

    def _on_tokens(self, turn_id: int, text: str) -> None:
        turn = self._current(turn_id)
        if turn is None:
            return
        turn.text += text
        if turn.bubble is not None:
            turn.bubble.append(text)
        if time.monotonic() - turn.last_save >= SAVE_EVERY_S:
            self.save_now()

    def _on_stats(self, turn_id: int, stats) -> None:
        turn = self._current(turn_id)
        if turn is not None:
            turn.stats = stats

    # ------------------------------------------------------------------ the end
    def _on_finished(self, outcome: TurnOutcome) -> None:
        turn = self._current(outcome.turn_id)
        if turn is None:
            return
        self.active = None
        if outcome.reason == "refused":
            self._roll_back(turn)
            self.refused.emit(outcome, turn)
            return
        if outcome.reason == "cancelled" and not outcome.text and not turn.text and not outcome.model_content:
            self._roll_back(turn)
            self.withdrawn.emit(outcome, turn)
            return
        text = outcome.text if outcome.text or not turn.text else turn.text
        stats = stats_dict(outcome.stats or turn.stats)
        status = FINISHED.get(outcome.reason, S.DONE)
        self._write(self.store.finish_reply, turn.reply_id, text, status, stats=stats, error=outcome.error,
                    finish_reason=outcome.reason)
        if outcome.model_content:
            self._write(self.store.set_model_content, turn.user_id, outcome.model_content)
        if turn.bubble is not None:
            if text != turn.bubble.text:
                turn.bubble.set_text(text)
            turn.bubble.set_progress("")
            turn.bubble.set_footer(S.reply_footer(stats, status, outcome.reason))
            if outcome.error:
                turn.bubble.set_error(outcome.error)
        turn.text = text
        self.finished.emit(outcome, turn)

    def withdraw_unanswered(self) -> ActiveTurn | None:
        """The window is closing: a turn whose reply has not begun is taken back as a stop before it would be (its
        rows gone: the new version, or the message with its reply); returned for its message to go back in the box.
        A reply under way is kept as it stands (closeEvent saves it as stopped)."""
        turn = self.active
        if turn is None or turn.text:
            return None
        self.active = None
        self._roll_back(turn)
        return turn

    def _roll_back(self, turn: ActiveTurn) -> None:
        if turn.new_version:  # the new version goes; the one shown before is shown again
            self._write(self.store.delete_message, turn.reply_id)
            gone = (turn.reply_id,)
        else:
            self._write(self.store.delete_messages_from, turn.user_id)
            gone = (turn.user_id, turn.reply_id)
        for bubble in list(self.view.bubbles):
            if bubble.message_id in gone:
                self.view.remove(bubble)


def stats_dict(stats) -> dict | None:
    if stats is None:
        return None
    data = dataclasses.asdict(stats) if dataclasses.is_dataclass(stats) else dict(vars(stats))
    ratio = getattr(stats, "compression_ratio", None)
    if ratio is not None:
        data["compression_ratio"] = float(ratio)
    return data
