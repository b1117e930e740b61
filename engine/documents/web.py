"""Web pages (.html, .htm, .xhtml): a saved page's readable text, not its markup.

A page saved from a browser is mostly scripts, styles and tags (a 27 KB documentation page holds ~4 KB of text);
read as source it would fill the context with markup and leave the model little of the article. So a file that is
a whole page (it has an ``<html>``, ``<body>`` or doctype) is read as what a browser shows: headings as ``#``
lines, list items as ``-`` lines, table cells split by ``|``, preformatted text kept as it is, and scripts,
styles, the ``<head>`` (its title aside), navigation menus and hidden elements left out. A fragment (a template or
a snippet, no such tag) stays source code. The document's note says which, and how to get the source instead.
"""

from __future__ import annotations

import json
import re
from html.parser import HTMLParser

WEB_SUFFIXES = frozenset({".html", ".htm", ".xhtml"})

_PAGE = re.compile(r"<!doctype\s+html|<html[\s>]|<body[\s>]", re.IGNORECASE)
# Elements whose content a reader never sees
_SKIPPED = frozenset({"script", "style", "noscript", "template", "svg", "math", "iframe", "object", "canvas",
                      "select", "nav", "button"})
_VOID = frozenset({"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "param", "source",
                   "track", "wbr"})
_BLOCKS = frozenset({"p", "div", "section", "article", "main", "header", "footer", "aside", "ul", "ol", "dl",
                     "table", "thead", "tbody", "tfoot", "tr", "blockquote", "figure", "figcaption", "form",
                     "fieldset", "address", "details", "summary", "dt", "dd", "caption", "center", "body"})
_HEADINGS = frozenset({"h1", "h2", "h3", "h4", "h5", "h6"})
_SPACED = frozenset({"p", "blockquote", "table", "ul", "ol", "figure"})  # blocks set apart by a blank line
_SPACE = re.compile(r"[ \t\r\n\f\v\u00a0]+")

NOTE = ("read as a web page: its text, without the markup, scripts and styles (rename it to .txt to ask about "
        "its source)")


def is_page(text: str) -> bool:
    """A whole web page (not a fragment): it has a doctype, an <html> or a <body>."""
    return _PAGE.search(text) is not None


# A server's short error page is often a bare fragment ("<center><h1>502 Bad Gateway</h1></center>", "<h1>403</h1>"):
# it begins with one of these elements, ends with a tag and shows little text
_FRAGMENT = re.compile(r"<(?:!--|(?:h[1-6]|p|div|center|title|head|meta|pre|span|b|strong|hr|br|a|table|script|"
                       r"style)[\s>/])", re.IGNORECASE)
_TAG = re.compile(r"<[^>]*>")


def _error_fragment(start: str) -> bool:
    return (_FRAGMENT.match(start) is not None and start.rstrip().endswith(">")
            and len(_TAG.sub("", start).strip()) < 1000)


def served(text: str) -> tuple[str, str, str] | None:
    """(what it is, what it may be, its suffix) for a text that is a whole web page, a short fragment of one (a
    server's bare error page) or a server's reply (XML, JSON) rather than prose, else None. A failed download saves
    that under the name of the file it was meant to fetch; a page must begin with its markup (a text that only
    mentions <body> further in is prose)."""
    start = text.lstrip("\ufeff \t\r\n")
    if start.startswith("<") and (is_page(text) or _error_fragment(start)):
        return "a web page (HTML)", "an error page", ".html"
    if start.startswith("<?xml"):
        return "an XML file", "a server's error message", ".xml"
    if start[:1] in ("{", "["):
        try:
            json.loads(start)
        except ValueError:
            return None
        return "a JSON file", "a server's error message", ".json"
    return None


class _Reader(HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.lines: list[str] = []
        self.line: list[str] = []
        self.title: list[str] = []
        self.skip: list[str] = []  # the open elements whose content is left out
        self.in_head = self.in_title = False
        self.pre = 0
        self.prefix = ""  # what the next line starts with ("# ", "- ")

    # -- lines ----------------------------------------------------------------------------------------
    def _end_line(self) -> None:
        text = "".join(self.line)
        if self.pre:  # kept as written, blank lines too
            self.lines.append(text.rstrip())
        else:
            text = _SPACE.sub(" ", text).strip()
            if text:
                self.lines.append(self.prefix + text)
        self.line, self.prefix = [], ""

    def _break(self, blank: bool = False) -> None:
        self._end_line()
        if blank and self.lines and self.lines[-1] != "":
            self.lines.append("")

    # -- parser events -------------------------------------------------------------------------------------
    def handle_starttag(self, tag, attrs):
        if tag in _VOID:
            if tag == "br" and not self.skip:
                self._end_line()
            elif tag == "hr" and not self.skip:
                self._break(blank=True)
            return
        attrs = dict(attrs)
        hidden = "hidden" in attrs or (attrs.get("aria-hidden") or "").lower() == "true"
        if self.skip or tag in _SKIPPED or hidden:
            self.skip.append(tag)
            return
        if tag == "head":
            self.in_head = True
        elif tag == "title":
            self.in_title = True
        elif tag in _HEADINGS:
            self._break(blank=True)
            self.prefix = "#" * int(tag[1]) + " "
        elif tag == "li":
            self._end_line()
            self.prefix = "- "
        elif tag in ("td", "th"):
            if "".join(self.line).strip():
                self.line.append(" | ")
        elif tag == "pre":
            self._break(blank=True)
            self.pre += 1
        elif tag in _BLOCKS:
            self._break(blank=tag in _SPACED)

    def handle_startendtag(self, tag, attrs):
        if tag in _VOID:
            self.handle_starttag(tag, attrs)

    def handle_endtag(self, tag):
        if self.skip:
            # close the innermost skipped element of this name (and anything left open inside it)
            if tag in self.skip:
                while self.skip and self.skip.pop() != tag:
                    pass
            return
        if tag == "head":
            self.in_head = False
        elif tag == "title":
            self.in_title = False
        elif tag in _HEADINGS:
            self._break(blank=True)
        elif tag == "pre":
            self._end_line()
            self.pre = max(0, self.pre - 1)
            self._break(blank=True)
        elif tag == "li" or tag in _BLOCKS:
            self._break(blank=tag in _SPACED)

    def handle_data(self, data):
        if self.skip:
            return
        if self.in_title:
            self.title.append(data)
        elif self.in_head:
            return
        elif self.pre:
            parts = data.split("\n")
            for part in parts[:-1]:
                self.line.append(part)
                self._end_line()
            self.line.append(parts[-1])
        else:
            self.line.append(data)

    def text(self) -> str:
        self._end_line()
        title = _SPACE.sub(" ", "".join(self.title)).strip()
        lines = self.lines
        while lines and lines[0] == "":
            lines = lines[1:]
        first = lines[0].lstrip("# ").strip() if lines else ""
        if title and title != first:
            lines = [title, ""] + lines
        return "\n".join(lines).strip()


def page_text(source: str) -> str:
    """A whole web page's readable text (see the module's docstring)."""
    reader = _Reader()
    reader.feed(source)
    reader.close()
    return reader.text()
