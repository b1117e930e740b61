"""A dropped folder gives the documents inside it (engine/documents/folder.py): by name, in name order, its
subfolders included, hidden files and tools' folders passed over, with a cap, and a sentence on what was left."""

from __future__ import annotations

import pytest

from engine.documents import folder as folder_module
from engine.documents.folder import folder_documents


def make(root, names):
    for name in names:
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"\x89PNG\r\n\x1a\n" if name.endswith(".png") else b"Some text.\n")
    return root


def test_the_documents_of_a_folder_and_its_subfolders_in_name_order(tmp_path):
    root = make(tmp_path / "notes", [
        "b-plan.md", "A-intro.txt", "code/main.py", "README", "scan.png", "bundle.zip", ".hidden.md",
        ".git/config", "node_modules/lib/index.js", "__pycache__/x.pyc", "env/pyvenv.cfg", "env/lib/site.py",
        "chapters/01.md", "chapters/02.pdf"])
    found = folder_documents(root)
    rel = [p[len(str(root)) + 1:] for p in found.files]
    assert rel == ["A-intro.txt", "b-plan.md", "chapters/01.md", "chapters/02.pdf", "code/main.py", "README"]
    assert dict(found.left_out) == {".png": 1, ".zip": 1}  # hidden files and tools' folders are not counted
    assert not found.more and not found.cut_short
    assert found.summary() == ('6 documents attached from the folder "notes". 2 other files left out (1 .png, '
                               '1 .zip).')


def test_a_folder_of_documents_only_says_nothing_more(tmp_path):
    found = folder_documents(make(tmp_path / "plain", ["one.md", "two.txt"]))
    assert len(found.files) == 2 and found.summary() == ""


def test_a_folder_without_documents_says_so(tmp_path):
    found = folder_documents(make(tmp_path / "photos", ["a.png", "b.png", "tool"]))
    assert found.files == []
    assert found.summary() == ('The folder "photos" holds no documents the app reads (PDF, Word, text, Markdown or '
                               'source files). 3 other files left out (2 .png, 1 without a suffix).')
    empty = tmp_path / "empty"
    empty.mkdir()
    assert folder_documents(empty).summary().startswith('The folder "empty" holds no documents')


def test_at_most_max_files_and_max_scanned(tmp_path, monkeypatch):
    root = make(tmp_path / "many", [f"doc{i:02}.md" for i in range(8)])
    monkeypatch.setattr(folder_module, "MAX_FILES", 3)
    found = folder_documents(root)
    assert [p[-8:] for p in found.files] == ["doc00.md", "doc01.md", "doc02.md"] and found.more == 5
    assert "5 more were not attached (at most 3 from one folder)" in found.summary()
    monkeypatch.setattr(folder_module, "MAX_SCANNED", 4)
    cut = folder_documents(root)
    assert cut.cut_short and len(cut.files) == 3 and "Only its first 4 entries were looked at" in cut.summary()


@pytest.mark.skipif(not hasattr(__import__("os"), "symlink"), reason="no symbolic links here")
def test_a_link_to_a_missing_file_is_left_out(tmp_path):
    root = make(tmp_path / "links", ["real.md"])
    (root / "gone.md").symlink_to(root / "nowhere.md")
    found = folder_documents(root)
    assert [p[-7:] for p in found.files] == ["real.md"] and dict(found.left_out) == {".md": 1}


@pytest.mark.skipif(__import__("os").geteuid() == 0 if hasattr(__import__("os"), "geteuid") else True,
                    reason="root reads every folder; needs POSIX permissions")
def test_a_folder_that_cannot_be_opened_says_so(tmp_path):
    root = make(tmp_path / "locked", ["a.md"])
    root.chmod(0)
    try:
        found = folder_documents(root)
    finally:
        root.chmod(0o755)
    assert found.files == [] and found.summary() == 'The folder "locked" could not be opened: permission denied.'


def test_a_folder_that_is_gone_says_so(tmp_path):
    found = folder_documents(tmp_path / "moved away")
    assert found.files == [] and found.summary() == ('The folder "moved away" could not be opened: no such file or '
                                                     'directory.')
