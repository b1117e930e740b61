"""Documents: drag-and-drop .md/.pdf/.docx (real text), chips with figures, the fit warning, bad inputs."""

from __future__ import annotations

import os
import threading

import pytest
from conftest import send
from gui_documents import write_docx, write_encrypted_pdf, write_markdown, write_pdf
from PySide6.QtCore import QMimeData, QPoint, QPointF, Qt, QUrl
from PySide6.QtGui import QDragEnterEvent, QDropEvent
from PySide6.QtWidgets import QApplication, QLabel


def drop(widget, paths):
    mime = QMimeData()
    mime.setUrls([QUrl.fromLocalFile(str(p)) for p in paths])
    center = widget.rect().center()
    enter = QDragEnterEvent(center, Qt.DropAction.CopyAction, mime, Qt.MouseButton.LeftButton,
                            Qt.KeyboardModifier.NoModifier)
    QApplication.sendEvent(widget, enter)
    assert enter.isAccepted()
    event = QDropEvent(QPointF(center), Qt.DropAction.CopyAction, mime, Qt.MouseButton.LeftButton,
                       Qt.KeyboardModifier.NoModifier)
    QApplication.sendEvent(widget, event)


def ready(window, count):
    return len(window.attached) == count and all(d is not None for d in window.attached.values())


def test_dropped_md_pdf_docx_are_attached_and_their_text_reaches_the_engine(qtbot, window, fake_model, tmp_path):
    md, md_snippet = write_markdown(tmp_path / "with-statement.md")
    pdf, pdf_snippet = write_pdf(tmp_path / "while-loop.pdf")
    docx, docx_snippet = write_docx(tmp_path / "for-loop.docx")
    parse_threads = []
    window.loader.parsed.connect(lambda *_: parse_threads.append(threading.current_thread().name))
    drop(window, [md, pdf])
    window.composer.insertFromMimeData(_mime([docx]))  # dropped on (or pasted into) the composer
    qtbot.waitUntil(lambda: ready(window, 3), timeout=10_000)

    chips = list(window.chips.chips.values())
    assert [c.document.name for c in chips] == ["with-statement.md", "while-loop.pdf", "for-loop.docx"]
    pdf_chip = chips[1]
    qtbot.waitUntil(lambda: "KV ≈" in pdf_chip.figures.text(), timeout=5_000)  # the engine's figures came
    assert "1 page ·" in pdf_chip.figures.text() and "chars" in pdf_chip.figures.text()
    assert "KV ≈" in pdf_chip.figures.text() and "×0.50" in pdf_chip.figures.text()
    assert "tokens" in pdf_chip.figures.text()
    assert not pdf_chip.warning.isVisible()

    send(qtbot, window, "What do these documents explain?")
    sent = fake_model.sends()[-1]["documents"]
    assert [d.name for d in sent] == ["with-statement.md", "while-loop.pdf", "for-loop.docx"]
    assert md_snippet in sent[0].text and pdf_snippet in sent[1].text and docx_snippet in sent[2].text
    assert sent[1].pages == 1
    assert not window.chips.chips  # the chips went with the message
    user = window.chat.bubbles[-2]
    assert "with-statement.md" in " ".join(label.text() for label in user.findChildren(type(user.footer)))

    # The documents stay part of the conversation: the next turn's history carries their text.
    send(qtbot, window, "And the second one?")
    history = fake_model.sends()[-1]["history"]
    assert pdf_snippet in history[0]["content"]


def _mime(paths):
    mime = QMimeData()
    mime.setUrls([QUrl.fromLocalFile(str(p)) for p in paths])
    return mime


def test_a_document_that_does_not_fit_says_which_knob_helps(qtbot, make_window, fake_model, tmp_path):
    fake_model.config = fake_model.config.replace(max_seq_len=2048)
    window = make_window()
    window.model_panel.max_seq_len.setValue(2048)
    window.model_panel.request_load()
    qtbot.waitUntil(lambda: window.facts is not None and window.facts.context_limit == 2048, timeout=5_000)
    big = tmp_path / "big.txt"
    big.write_text(("The quick brown fox jumps over the lazy dog. " * 400), encoding="utf-8")
    window.attach_files([str(big)])
    qtbot.waitUntil(lambda: ready(window, 1), timeout=10_000)
    chip = window.chips.chips[next(iter(window.chips.chips))]
    qtbot.waitUntil(lambda: chip.warning.isVisible(), timeout=3_000)
    assert "max_seq_len" in chip.warning.text() and "8,192" in chip.warning.text()


def test_a_short_documents_kv_is_the_cache_floor_not_the_ratio(qtbot, window, fake_model, tmp_path):
    """At ratio 0.2 a ~60-token document in a fresh chat is kept whole (the cache never compacts below its
    128-entry floor): its KV is 60 entries' worth, not the 12 that tokens × ratio would say."""
    from gui_fakes import KV_BYTES_PER_TOKEN
    from test_knobs import slider_to

    from app.format import fmt_bytes

    slider_to(window, "kv_cache_ratio", 0.2)
    qtbot.waitUntil(lambda: fake_model.config.kv_cache_ratio == 0.2, timeout=3_000)
    note = tmp_path / "note.txt"
    note.write_text("A short note about the garden. " * 7, encoding="utf-8")
    window.attach_files([str(note)])
    key = next(iter(window.attached))
    qtbot.waitUntil(lambda: key in window.doc_figures, timeout=10_000)
    figures = window.doc_figures[key]
    assert 40 <= figures.tokens < 128 and figures.kv_cache_ratio == 0.2
    assert figures.kv_bytes == figures.tokens * KV_BYTES_PER_TOKEN  # min(tokens, 128) entries
    assert figures.kv_bytes > 4 * int(figures.tokens * 0.2 * KV_BYTES_PER_TOKEN)
    chip = window.chips.chips[key]
    assert f"KV ≈ {fmt_bytes(figures.kv_bytes)} at ×0.20" in chip.figures.text()


def test_fit_uses_the_engines_bytes_for_free_memory():
    from app.documents import assess_fit

    common = dict(tokens=50_000, tokens_before=0, context_limit=131_072, max_positions=131_072,
                  bytes_per_token=10_000, prefill_headroom=None, kv_dtype="auto")
    roomy = assess_fit(**common, kv_bytes=250_000_000, kv_after=250_000_000, free_bytes=1_000_000_000)
    assert roomy.fits and roomy.kv_bytes == 250_000_000
    tight = assess_fit(**common, kv_bytes=250_000_000, kv_after=250_000_000, free_bytes=200_000_000)
    assert not tight.fits and "lower Cache ratio to 0.36" in tight.warning  # 0.9 × 200 MB of 500 MB
    unknown = assess_fit(**common, kv_bytes=None, kv_after=None, free_bytes=200_000_000)
    assert unknown.fits and unknown.kv_bytes is None  # until the engine's figures come


def _binary(path):
    path.write_bytes(b"\x00\x01\x02binary\x00" * 100)
    return path


def _huge(path):
    with open(path, "wb") as fh:
        fh.truncate(65 * 1024 * 1024)  # sparse: over the 64 MiB limit without writing it
    return path


def _unsupported(path):
    path.write_bytes(b"MZ\x90\x00")
    return path


def _empty(path):
    path.write_text("", encoding="utf-8")
    return path


def _photo(path):
    path.write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR" + bytes(64))
    return path


@pytest.mark.parametrize(("name", "make", "words"), [
    ("program.exe", _unsupported, "not supported"),
    ("photo", _photo, "it is a PNG image"),  # no suffix: tried, and what it is said
    ("notes.txt", _binary, "doesn't look like a text file"),
    ("locked.pdf", write_encrypted_pdf, "password-protected"),
    ("huge.txt", _huge, "the limit is"),
    ("empty.md", _empty, "contains no text"),
    ("missing.md", None, "was not found"),
])
def test_bad_files_show_their_message_and_change_nothing(qtbot, window, fake_model, tmp_path, name, make, words):
    send(qtbot, window, "Hello")
    window.composer.setPlainText("my draft")
    path = tmp_path / name
    if make is not None:
        make(path)
    messages_before = len(window.shown_messages)
    drop(window, [path])
    qtbot.waitUntil(lambda: len(window.shown_messages) > messages_before, timeout=10_000)
    title, text = window.shown_messages[-1]
    assert title == "Could not attach the file"
    assert name in text and words in text
    assert not window.attached and not window.chips.chips
    assert window.composer.toPlainText() == "my draft"
    assert len(window.chat.bubbles) == 2
    assert window.send_button.isEnabled()


def test_a_pdf_without_a_suffix_and_a_word_file_named_pdf_are_read_by_their_content(qtbot, window, fake_model,
                                                                                      tmp_path):
    pdf, pdf_snippet = write_pdf(tmp_path / "saved.pdf")
    report = tmp_path / "report"  # as a browser saves a download it has no name for
    os.rename(pdf, report)
    docx, docx_snippet = write_docx(tmp_path / "made.docx")
    memo = tmp_path / "memo.pdf"
    os.rename(docx, memo)
    drop(window, [report, memo])
    qtbot.waitUntil(lambda: ready(window, 2), timeout=10_000)
    chips = list(window.chips.chips.values())
    assert [c.document.kind for c in chips] == ["pdf", "docx"]
    qtbot.waitUntil(lambda: all(c.warning.text() for c in chips), timeout=5_000)
    assert '"report" is a PDF file; read as PDF.' in chips[0].warning.text()
    assert '"memo.pdf" is a Word document; read as Word.' in chips[1].warning.text()
    send(qtbot, window, "Summarise both")
    sent = fake_model.sends()[-1]["documents"]
    assert pdf_snippet in sent[0].text and docx_snippet in sent[1].text


def test_sending_while_a_document_is_being_read_waits(qtbot, window, fake_model, tmp_path, slow_reading):
    gate = slow_reading
    md, _ = write_markdown(tmp_path / "slow.md")
    window.attach_files([str(md)])
    window.composer.setPlainText("Summarise it")
    window.send()
    assert window.shown_messages[-1][0] == "Still reading documents"
    assert not fake_model.sends()
    gate.set()
    qtbot.waitUntil(lambda: ready(window, 1), timeout=5_000)
    send(qtbot, window, "Summarise it")
    assert fake_model.sends()[-1]["documents"][0].name == "slow.md"


def test_folder_drop_is_refused_with_a_message(qtbot, window, tmp_path):
    folder = tmp_path / "a-folder"
    os.mkdir(folder)
    drop(window, [folder])
    qtbot.waitUntil(lambda: bool(window.shown_messages), timeout=5_000)
    assert "folder" in window.shown_messages[-1][1]


def test_the_attach_dialog_opens_on_every_file_so_a_download_without_a_suffix_can_be_picked(qtbot, window, fake_model,
                                                                                             tmp_path, monkeypatch):
    # its "Documents" filter hid a file without a suffix: a PDF a browser saved as "report" was only under All files
    from PySide6.QtWidgets import QFileDialog

    pdf, pdf_snippet = write_pdf(tmp_path / "saved.pdf")
    report = tmp_path / "report"
    os.rename(pdf, report)
    asked = []

    def pick(parent, caption, folder, filters, selected="", *args):
        asked.append((filters, selected))
        return [str(report)], selected

    monkeypatch.setattr(QFileDialog, "getOpenFileNames", staticmethod(pick))
    window.actions_by_name["attach"].trigger()
    assert len(asked) == 1
    filters, selected = asked[0]
    names = filters.split(";;")
    assert names[0] == "All files (*)" and selected in ("", names[0])  # the one it opens with
    documents = next(f for f in names if f.startswith("Documents ("))  # still there to narrow the list
    assert all(f"*{suffix} " in documents or f"*{suffix})" in documents for suffix in (".pdf", ".docx", ".docm", ".txt"))
    qtbot.waitUntil(lambda: ready(window, 1), timeout=10_000)
    chip = next(iter(window.chips.chips.values()))
    assert chip.document.kind == "pdf" and pdf_snippet in window.attached[next(iter(window.attached))].text

    dialog = QFileDialog(window, "Attach documents", str(tmp_path), filters)  # Qt's own reading of the string
    assert dialog.selectedNameFilter() == "All files (*)" and len(dialog.nameFilters()) == 2
    dialog.deleteLater()


def test_a_dropped_folder_attaches_the_documents_inside_it(qtbot, window, fake_model, tmp_path):
    folder = tmp_path / "project notes"
    (folder / "part two").mkdir(parents=True)
    md, md_snippet = write_markdown(folder / "a-with.md")
    pdf, pdf_snippet = write_pdf(folder / "part two" / "b-while.pdf")
    (folder / "photo.png").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(64))
    drop(window, [folder])
    qtbot.waitUntil(lambda: ready(window, 2), timeout=10_000)
    assert [c.document.name for c in window.chips.chips.values()] == ["a-with.md", "b-while.pdf"]
    assert window.statusBar().currentMessage() == ('2 documents attached from the folder "project notes". 1 other '
                                                   'file left out (1 .png).')
    send(qtbot, window, "What do these notes say?")
    sent = fake_model.sends()[-1]["documents"]
    assert md_snippet in sent[0].text and pdf_snippet in sent[1].text


def test_a_dropped_folder_without_documents_says_so_and_attaches_nothing(qtbot, window, tmp_path):
    folder = tmp_path / "photos"
    folder.mkdir()
    (folder / "photo.png").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(64))
    told = []
    window.inform = lambda title, text, **_kw: told.append((title, text))
    drop(window, [folder])
    qtbot.waitUntil(lambda: bool(told), timeout=5_000)
    assert told == [("Could not attach the folder", 'The folder "photos" holds no documents the app reads (PDF, Word, '
                     "text, Markdown or source files). 1 other file left out (1 .png).")]
    assert not window.attached and not window.chips.chips


def test_a_folder_is_listed_off_the_gui_thread_its_chip_standing_for_it_until_then(qtbot, window, fake_model,
                                                                                  tmp_path, monkeypatch):
    import threading

    from engine.documents import folder as folder_module

    folder = tmp_path / "share"
    folder.mkdir()
    write_markdown(folder / "notes.md")
    gate, threads = threading.Event(), []
    real = folder_module.folder_documents

    def slow_share(path):  # a network share: seconds to walk
        threads.append(threading.current_thread())
        gate.wait(10)
        return real(path)

    monkeypatch.setattr(folder_module, "folder_documents", slow_share)
    drop(window, [folder])
    qtbot.waitUntil(lambda: bool(threads), timeout=5_000)
    assert threads[0] is not threading.main_thread()
    assert [c.title.text() for c in window.chips.chips.values()] == ["Reading share…"]
    assert list(window.attached.values()) == [None]
    window.composer.setPlainText("What is in the share?")
    window.send()  # the folder is still being listed: its documents would be missing
    assert window.shown_messages[-1][0] == "Still reading documents" and not fake_model.sends()
    gate.set()
    qtbot.waitUntil(lambda: ready(window, 1), timeout=10_000)
    assert [c.document.name for c in window.chips.chips.values()] == ["notes.md"]
    send(qtbot, window, "What is in the share?")
    assert fake_model.sends()[-1]["documents"][0].name == "notes.md"


def test_attach_a_folder_from_the_chat_menu(qtbot, window, monkeypatch, tmp_path):
    from PySide6.QtWidgets import QFileDialog

    folder = tmp_path / "picked"
    folder.mkdir()
    write_markdown(folder / "notes.md")
    monkeypatch.setattr(QFileDialog, "getExistingDirectory", staticmethod(lambda *a, **k: str(folder)))
    action = window.actions_by_name["attach_folder"]
    assert action.shortcut().toString() == "Ctrl+Shift+O"
    action.trigger()
    qtbot.waitUntil(lambda: ready(window, 1), timeout=10_000)
    assert [c.document.name for c in window.chips.chips.values()] == ["notes.md"]


def test_the_text_the_model_reads_is_shown_from_the_chip_and_from_the_sent_message(qtbot, window, fake_model,
                                                                                      tmp_path):
    pdf, pdf_snippet = write_pdf(tmp_path / "while-loop.pdf")
    window.attach_files([str(pdf)])
    qtbot.waitUntil(lambda: ready(window, 1), timeout=10_000)
    chip = next(iter(window.chips.chips.values()))
    assert chip.show_text.isEnabled()
    chip.show_text.click()
    dialog = window.text_windows[-1]
    assert dialog.isVisible() and dialog.windowTitle() == "while-loop.pdf — the text the model reads"
    assert dialog.text.toPlainText() == window.attached[chip.key].text and pdf_snippet in dialog.text.toPlainText()
    assert dialog.figures.text().startswith("PDF · 1 page · ")
    word = pdf_snippet.split()[-1]
    dialog.find.setText(word)
    assert dialog.find_next() and dialog.text.textCursor().selectedText().lower() == word.lower()
    dialog.find.setText("no such words anywhere")
    assert not dialog.find_next() and dialog.found.text() == "not found"
    dialog.close()
    qtbot.waitUntil(lambda: not window.text_windows, timeout=2_000)

    send(qtbot, window, "What does it explain?")
    sent_text = fake_model.sends()[-1]["documents"][0].text
    user = window.chat.bubbles[-2]
    link = next(label for label in user.findChildren(QLabel) if "while-loop.pdf" in label.text())
    link.linkActivated.emit("document:0")  # the user clicks the attachment's name
    dialog = window.text_windows[-1]
    assert dialog.text.toPlainText() == sent_text  # what was stored with the message: what the model read
    window.show_conversation(window.conversation_id)  # reopened (from the store): the same
    user = window.chat.bubbles[-2]
    next(label for label in user.findChildren(QLabel) if "while-loop.pdf" in label.text()).linkActivated.emit(
        "document:0")
    assert window.text_windows[-1].text.toPlainText() == sent_text


def test_a_sent_documents_text_is_tinted_by_what_the_cache_holds_and_follows_the_knobs(qtbot, window, fake_model,
                                                                                        tmp_path):
    from test_knobs import slider_to

    from app import theme

    md, _ = write_markdown(tmp_path / "notes.md")
    window.attach_files([str(md)])
    qtbot.waitUntil(lambda: ready(window, 1), timeout=10_000)
    next(iter(window.chips.chips.values())).show_text.click()
    before = window.text_windows[-1]  # not read by the chat yet: nothing to tint, and it says when there will be
    qtbot.waitUntil(lambda: "once the chat has read it" in before.heat_label.text(), timeout=5_000)
    assert not before.tints() and not before.tint.isVisible()
    before.text.selectAll()
    assert not before.keep_hot.isVisible()  # nothing to keep hot before the chat has read it
    before.close()

    send(qtbot, window, "What does it say?")
    user = window.chat.bubbles[-2]
    next(label for label in user.findChildren(QLabel) if "notes.md" in label.text()).linkActivated.emit("document:0")
    dialog = window.text_windows[-1]
    qtbot.waitUntil(lambda: dialog.heat is not None, timeout=5_000)
    asked = [c for c in fake_model.calls if c[0] == "document_heat"]
    assert asked and asked[-1][2] != "MainThread"  # the engine was asked on the worker thread
    heat = dialog.heat
    assert f"Held hot now: {heat.hot_share:.0%} of its {heat.tokens:,} tokens" in dialog.heat_label.text()
    assert "cache ratio 0.50" in dialog.heat_label.text() and "cold tier in RAM" in dialog.heat_label.text()
    # the fake holds the first third in every slot (level 3), the second in half (level 2), the rest cold (no tint)
    tints = dialog.tints()
    assert {colour for _, _, colour, _ in tints} == {theme.colors()["heat_3"], theme.colors()["heat_2"]}
    assert tints[0][0] == heat.spans[0][0]
    third = len(dialog.document_text) / 3
    assert all((colour == theme.colors()["heat_3"]) == (start < third) for start, _, colour, _ in tints)
    assert all(start < 2 * third for start, _, _, _ in tints)  # the last third cold: untinted
    assert dialog.share_at(heat.spans[0][0]) == 1.0 and dialog.share_at(heat.spans[-1][0]) == 0.0
    # the strip beside the text: the whole document at a glance (thirds: hot, half, cold), a click goes there
    assert dialog.strip.isVisible() and dialog.strip.row_levels(3) == [3, 2, 0]
    qtbot.mouseClick(dialog.strip, Qt.MouseButton.LeftButton, pos=QPoint(5, dialog.strip.height() - 1))
    assert dialog.text.textCursor().position() >= 0.95 * len(dialog.document_text)
    qtbot.mouseClick(dialog.strip, Qt.MouseButton.LeftButton, pos=QPoint(5, 0))
    assert dialog.text.textCursor().position() == 0
    dialog.tint.setChecked(False)
    assert not dialog.tints() and not dialog.strip.isVisible()
    dialog.tint.setChecked(True)
    assert dialog.tints() and dialog.strip.isVisible()

    slider_to(window, "kv_cache_ratio", 0.3)  # the knobs change what the cache holds: the open window follows
    qtbot.waitUntil(lambda: dialog.heat is not None and dialog.heat.ratio == 0.3, timeout=10_000)
    assert "cache ratio 0.30" in dialog.heat_label.text()

    window.client.worker._sessions.clear()  # as after a restart: the chat's cache not loaded until it is asked again
    window._request_heat(dialog)
    qtbot.waitUntil(lambda: dialog.heat is None, timeout=5_000)
    assert "loaded when you next ask it something" in dialog.heat_label.text()
    assert not dialog.tints() and not dialog.strip.isVisible() and not dialog.tint.isVisible()


def test_a_selected_piece_is_kept_hot_for_the_chat_stored_with_it_and_sent_with_each_turn(qtbot, window, fake_model,
                                                                                           tmp_path):
    from PySide6.QtGui import QTextCursor

    md, _ = write_markdown(tmp_path / "notes.md")
    window.attach_files([str(md)])
    qtbot.waitUntil(lambda: ready(window, 1), timeout=10_000)
    send(qtbot, window, "What does it say?")
    user = window.chat.bubbles[-2]
    next(label for label in user.findChildren(QLabel) if "notes.md" in label.text()).linkActivated.emit("document:0")
    dialog = window.text_windows[-1]
    qtbot.waitUntil(lambda: dialog.heat is not None, timeout=5_000)
    assert not dialog.keep_hot.isEnabled()  # nothing selected
    cursor = dialog.text.textCursor()
    cursor.setPosition(0)
    cursor.setPosition(24, QTextCursor.MoveMode.KeepAnchor)
    dialog.text.setTextCursor(cursor)
    piece = dialog.document_text[:24].strip()
    assert dialog.keep_hot.isEnabled()
    dialog.keep_hot.click()
    qtbot.waitUntil(lambda: dialog.pins == [piece], timeout=5_000)
    pinned = [c for c in fake_model.calls if c[0] == "set_pins"]
    assert pinned[-1][3]["pins"] == [piece] and pinned[-1][2] != "MainThread"
    assert window.store.chat_settings(window.conversation_id)["pins"] == [piece]
    assert dialog.pins_label.text() == "Kept hot: 1 part of this text" and dialog.unpin.isVisible()
    from engine.heat import DocumentHeat

    cold = DocumentHeat(tuple((s, e, 0.5) for s, e, _ in dialog.heat.spans), 0.5, dialog.heat.tokens, 0, "ram", 0.1)
    dialog.show_heat(cold)  # as after the ratio went down past the pins' room: the engine's heat says so
    assert dialog.pins_label.text() == ("Kept hot: 1 part of this text; 1 not wholly hot at cache ratio 0.10: raise "
                                        "the ratio, or unpin to let the cache choose")
    window._request_heat(dialog)
    qtbot.waitUntil(lambda: dialog.pins_label.text() == "Kept hot: 1 part of this text", timeout=5_000)
    underlined = {i for start, end, _, under in dialog.tints() if under for i in range(start, end)}
    assert underlined == {i for i in range(len(piece)) if piece[i] != "\n"}  # the piece, but its line breaks
    assert "Kept hot" in window.statusBar().currentMessage()

    send(qtbot, window, "And then?")  # every turn carries the chat's pins to its engine session
    assert fake_model.sessions[-1].pins == [piece]
    # pinned while a reply streams: the engine answers after the reply, and a message sent before that carries them
    fake_model.token_delay = 0.05
    fake_model.reply_text = " ".join(f"w{i}" for i in range(30))
    send(qtbot, window, "Stream a while", wait=False)
    qtbot.waitUntil(lambda: bool(window.turns.active and window.turns.active.text), timeout=5_000)
    other = dialog.document_text[30:60].strip()
    window._send_pins(dialog, [piece, other])
    assert window._pins(window.conversation_id) == [piece, other]
    qtbot.waitUntil(lambda: not window.turns.busy, timeout=10_000)
    fake_model.token_delay, fake_model.reply_text = 0.0, None
    send(qtbot, window, "And now?")
    assert fake_model.sessions[-1].pins == [piece, other]
    qtbot.waitUntil(lambda: window.store.chat_settings(window.conversation_id)["pins"] == [piece, other], timeout=5_000)
    window._send_pins(dialog, [piece])
    qtbot.waitUntil(lambda: dialog.pins == [piece], timeout=5_000)
    window.show_conversation(window.conversation_id)  # the knobs saved again: the pins stay with the chat
    assert window.store.chat_settings(window.conversation_id)["pins"] == [piece]

    cursor.setPosition(0)
    cursor.setPosition(len(dialog.document_text), QTextCursor.MoveMode.KeepAnchor)
    dialog.text.setTextCursor(cursor)
    told = []
    window.inform = lambda title, text, **_kw: told.append((title, text))
    dialog.keep_hot.click()  # the whole text: more than the cache has room for
    qtbot.waitUntil(lambda: bool(told), timeout=5_000)
    assert told[-1][0] == "Could not keep it hot" and "room" in told[-1][1]
    assert window.store.chat_settings(window.conversation_id)["pins"] == [piece] and dialog.pins == [piece]

    dialog.unpin.click()
    qtbot.waitUntil(lambda: dialog.pins == [], timeout=5_000)
    assert window.store.chat_settings(window.conversation_id)["pins"] == []
    assert not dialog.unpin.isVisible() and not any(underlined for *_, underlined in dialog.tints())


def test_the_chat_menu_opens_what_the_cache_holds_of_the_last_documents_sent(qtbot, window, fake_model, tmp_path):
    action = window.actions_by_name["document_memory"]
    assert action.shortcut().toString() == "Ctrl+Shift+H"
    assert "Ctrl+Shift+H — What the cache holds of the documents" in window.shortcut_lines()
    action.trigger()  # a chat without documents: says how to get there
    assert window.shown_messages[-1][0] == "No documents in this chat" and not window.text_windows
    md, _ = write_markdown(tmp_path / "notes.md")
    window.attach_files([str(md)])
    qtbot.waitUntil(lambda: ready(window, 1), timeout=10_000)
    send(qtbot, window, "What does it say?")
    send(qtbot, window, "And more?")  # the last message with documents is an earlier one
    action.trigger()
    (dialog,) = window.text_windows
    assert dialog.windowTitle().startswith("notes.md") and dialog.conversation_id == window.conversation_id
    qtbot.waitUntil(lambda: dialog.heat is not None, timeout=5_000)


def test_the_tint_lands_on_the_right_characters_past_u_ffff(qtbot):
    from app.widgets.document_text import DocumentTextDialog
    from engine.heat import DocumentHeat

    text = "emoji 😀😀 then the fact"  # two characters past U+FFFF: two UTF-16 units each in Qt's document
    document = type("D", (), {"name": "e.txt", "kind": "txt", "pages": None, "chars": len(text), "text": text})()
    dialog = DocumentTextDialog(document)
    qtbot.addWidget(dialog)
    fact = text.index("fact")
    dialog.show_heat(DocumentHeat(((0, 5, 0.0), (fact, fact + 4, 1.0)), 0.5, 2, 0, "off", 0.2))
    ((start, end, _, _),) = dialog.tints()
    assert dialog.text.toPlainText()[start:end] != "fact"  # Qt counts the two emoji as two units each
    assert (start, end) == (fact + 2, fact + 6)
    cursor = dialog.text.textCursor()
    cursor.setPosition(start)
    cursor.setPosition(end, cursor.MoveMode.KeepAnchor)
    assert cursor.selectedText() == "fact"
    assert "discarded" in dialog.heat_label.text()


def test_a_chip_still_being_read_has_no_text_to_show(qtbot, window, tmp_path, slow_reading):
    md, _ = write_markdown(tmp_path / "notes.md")
    window.attach_files([str(md)])
    chip = next(iter(window.chips.chips.values()))
    assert not chip.show_text.isEnabled()
    assert window.show_document_text(None) is None and not window.text_windows
    slow_reading.set()
    qtbot.waitUntil(lambda: ready(window, 1), timeout=10_000)
    assert chip.show_text.isEnabled()


def test_files_of_a_folder_that_cannot_be_read_are_named_in_one_message(qtbot, window, tmp_path):
    folder = tmp_path / "downloads"
    folder.mkdir()
    for name in ("a.pdf", "b.pdf", "c.pdf"):
        (folder / name).write_bytes(b"")  # failed downloads: empty
    write_markdown(folder / "d.md")
    drop(window, [folder])
    qtbot.waitUntil(lambda: ready(window, 1) and len(window.shown_messages) >= 3, timeout=10_000)
    boxes = [b for b in window.open_dialogs if "attach" in b.windowTitle()]
    assert len(boxes) == 1 and boxes[0].windowTitle() == "Could not attach 3 files"
    assert all(f'"{name}" is empty' in boxes[0].text() for name in ("a.pdf", "b.pdf", "c.pdf"))
    assert [c.document.name for c in window.chips.chips.values()] == ["d.md"]
    boxes[0].done(0)  # read and closed: the next failure has a message of its own
    qtbot.waitUntil(lambda: boxes[0] not in window.open_dialogs, timeout=2_000)
    drop(window, [folder / "a.pdf"])
    qtbot.waitUntil(lambda: any(b.windowTitle() == "Could not attach the file" for b in window.open_dialogs),
                    timeout=10_000)


def test_the_attach_dialogs_open_where_documents_were_last_picked(qtbot, make_window, monkeypatch, tmp_path):
    from pathlib import Path

    from PySide6.QtWidgets import QFileDialog

    from app.settings import Key

    papers = tmp_path / "papers"
    papers.mkdir()
    md, _ = write_markdown(papers / "notes.md")
    opened = []

    def pick_files(parent, caption, folder, *args):
        opened.append(folder)
        return [str(md)], ""

    def pick_folder(parent, caption, folder, *args):
        opened.append(folder)
        return str(papers)

    monkeypatch.setattr(QFileDialog, "getOpenFileNames", staticmethod(pick_files))
    monkeypatch.setattr(QFileDialog, "getExistingDirectory", staticmethod(pick_folder))
    window = make_window()
    window.actions_by_name["attach"].trigger()
    assert opened[-1] == str(Path.home())  # nothing picked yet
    window.actions_by_name["attach"].trigger()
    assert opened[-1] == str(papers)  # where the last file came from
    window.actions_by_name["attach_folder"].trigger()
    assert opened[-1] == str(papers)
    assert make_window()._documents_folder() == str(tmp_path)  # the folder's parent, kept across starts
    window.settings.set(Key.DOCUMENTS_FOLDER, str(tmp_path / "gone"))
    assert window._documents_folder() == str(Path.home())  # moved or deleted since: home
