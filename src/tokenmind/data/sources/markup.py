"""Documentation markup to plain text: reStructuredText, HTML and Perl POD, plus the two
layout helpers (`tidy`, `unwrap`) the extractors share.

These are deliberately light converters, written for the manuals the sources ship (Sphinx
`_sources`, DocBook and mdBook HTML, perl's POD): they keep prose and code as written and drop
navigation and indexing markup, rather than render the markup faithfully.
"""

from __future__ import annotations

import html
import re
from html.parser import HTMLParser


def tidy(text: str) -> str:
    """Strip trailing spaces, collapse runs of blank lines to one, and trim the ends."""
    lines = [line.rstrip() for line in text.split("\n")]
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip("\n")


def unwrap(text: str) -> str:
    """Join hard-wrapped lines within each blank-line separated paragraph."""
    return "\n\n".join(" ".join(p.split()) for p in re.split(r"\n\s*\n", text) if p.strip())


_RST_ROLE = re.compile(r":[\w:+-]+:`(?:([^`<]*?)\s*<[^`>]*>|~?([^`]*))`")
_RST_LINK = re.compile(r"`([^`<]+?)\s*<[^`>]+>`__?")
_RST_DROP = re.compile(r"^\.\. (?:_[^:]+:|index::|highlight::|sectionauthor::|moduleauthor::|toctree::|"
                       r"tabularcolumns::|only::|contents::|c:namespace-push::|c:namespace-pop::|SPDX)")  # fmt: skip


def rst_to_text(text: str) -> str:
    """Light reStructuredText clean-up: roles and links become their text; index, label and toctree
    directives (with their indented bodies) are dropped. Code blocks and prose stay as written."""
    out: list[str] = []
    dropping = False
    for line in text.split("\n"):
        if _RST_DROP.match(line):
            dropping = True
            continue
        if dropping and (not line.strip() or line[:1] in " \t"):
            continue
        dropping = False
        line = _RST_ROLE.sub(lambda m: (m.group(1) if m.group(1) is not None else m.group(2)).lstrip("!"), line)
        out.append(_RST_LINK.sub(r"\1", line).replace("`_", "`"))
    return tidy("\n".join(out))


class _HTMLText(HTMLParser):
    BLOCK = {"p", "div", "section", "article", "main", "table", "ul", "ol", "dl", "blockquote", "pre", "hr",
             "h1", "h2", "h3", "h4", "h5", "h6", "figure", "header"}  # fmt: skip
    LINE = {"br", "li", "tr", "dt", "dd", "caption", "figcaption"}
    SKIP = {"script", "style", "head", "nav", "noscript", "button", "svg", "form", "select", "footer"}
    SKIP_MARKERS = {"sphinxsidebar", "related", "nav", "navheader", "navfooter", "sidebar", "menu-bar", "hd",
                    "ft", "global-nav", "searchbox", "search-wrapper", "searchresults-outer", "headerlink",
                    "breadcrumbs", "footer", "nav-wrapper", "nav-wide-wrapper"}  # fmt: skip
    VOID = {"br", "hr", "img", "meta", "link", "input", "wbr", "area", "base", "col", "source"}

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.parts: list[str] = []
        self.skip_tag: str | None = None
        self.skip_depth = 0
        self.pre = 0

    def _newline(self, n: int) -> None:
        self.parts.append("\n" * n)

    def handle_starttag(self, tag, attrs):
        if self.skip_tag is not None:
            self.skip_depth += tag == self.skip_tag
            return
        marks = {v for k, v in attrs if k == "id" and v} | {
            c for k, v in attrs if k == "class" and v for c in v.split()
        }
        if tag not in self.VOID and (tag in self.SKIP or marks & self.SKIP_MARKERS):
            self.skip_tag, self.skip_depth = tag, 1
            return
        if tag == "pre":
            self.pre += 1
        if tag in self.BLOCK:
            self._newline(2)
        elif tag in self.LINE:
            self._newline(1)
        elif tag in ("td", "th"):
            self.parts.append(" ")

    def handle_endtag(self, tag):
        if self.skip_tag is not None:
            if tag == self.skip_tag:
                self.skip_depth -= 1
                if self.skip_depth == 0:
                    self.skip_tag = None
            return
        if tag == "pre":
            self.pre = max(0, self.pre - 1)
        if tag in self.BLOCK:
            self._newline(2)

    def handle_data(self, data):
        if self.skip_tag is not None:
            return
        if self.pre:
            self.parts.append(data)
            return
        data = re.sub(r"\s+", " ", data)
        if not self.parts or self.parts[-1].endswith("\n"):
            data = data.lstrip()
        self.parts.append(data)


def html_to_text(markup: str) -> str:
    """Readable text of an HTML page: navigation, sidebars, scripts and styles dropped, `<pre>`
    kept verbatim, block elements separated by blank lines."""
    parser = _HTMLText()
    parser.feed(markup)
    parser.close()
    return tidy("".join(parser.parts))


_POD_ESCAPES = {"lt": "<", "gt": ">", "verbar": "|", "sol": "/", "quot": '"', "amp": "&", "apos": "'"}


def _pod_code(code: str, body: str) -> str:
    if code == "E":
        if body in _POD_ESCAPES:
            return _POD_ESCAPES[body]
        if body[:1].isdigit():  # decimal, 0x hex or 0 octal
            return chr(int(body, 16 if body[:2].lower() == "0x" else 8 if body[:1] == "0" and len(body) > 1 else 10))
        return html.unescape(f"&{body};")
    if code in "XZ":
        return ""
    if code == "L":
        text, _, target = body.partition("|")
        if not target:  # L<name/"section"> or L<name>
            text = re.sub(r'^(.*?)/"?(.*?)"?$', lambda m: f"{m.group(2)} in {m.group(1)}" if m.group(1) else m.group(2),
                          text, flags=re.S)  # fmt: skip
        return text
    return body


def pod_to_text(pod: str) -> str:
    """Plain text of Perl POD: headings and items kept as lines, formatting codes resolved,
    verbatim (indented) paragraphs kept as code, `=begin`/`=for` blocks and `=cut` code dropped."""
    out: list[str] = []
    in_pod, skip_until = False, None
    for para in re.split(r"\n\s*\n", pod):
        if para.startswith("="):
            command, _, rest = para[1:].partition(" ")
            command, rest = command.strip(), rest.strip()
            in_pod = command != "cut"
            if skip_until:
                skip_until = None if command == "end" else skip_until
                continue
            if command == "begin":
                skip_until = "end"
            elif command.startswith("head") or command == "item":
                bullet = "* " if command == "item" and rest not in ("*", "") else ""
                out.append(bullet + _pod_inline(rest.lstrip("* ")))
            continue
        if not in_pod or skip_until:
            continue
        out.append(para.rstrip() if para[:1] in " \t" else " ".join(_pod_inline(para).split()))
    return tidy("\n\n".join(p for p in out if p.strip()))


def _pod_inline(text: str) -> str:
    text = re.sub(r"([A-Z])<{2,}\s+(.*?)\s+>{2,}", lambda m: _pod_code(m.group(1), m.group(2)), text, flags=re.S)
    while True:
        new = re.sub(r"([A-Z])<([^<>]*)>", lambda m: _pod_code(m.group(1), m.group(2)), text)
        if new == text:
            return text
        text = new
