"""The docs a newcomer reads hold together: every relative link and image in README.md, tests/README.md and docs/ resolves.

A link's file must exist (relative to the Markdown file that holds it), an image must be a file, and an
anchor (``file.md#heading`` or ``#heading``) must name a heading of its target, slugged as GitHub does.
Links inside code (fenced blocks, inline spans) are text, not links. The layer diagram the README shows
must be drawn from the layer ranks tests/project/test_layout.py enforces (``docs/diagrams/make_layers.py``).
"""

from __future__ import annotations

import re
import struct
import zlib
from pathlib import Path

import pytest

from tests.helpers import REPO

DOCS = [REPO / "README.md", REPO / "tests" / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
#: ``[text](target)`` / ``![alt](target)``, the target up to whitespace or ``)`` (an optional title after)
LINK = re.compile(r"(!?)\[(?:[^\]\[]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HTML_SRC = re.compile(r"<img\s[^>]*src=\"([^\"]+)\"", re.I)
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
EXTERNAL = ("http://", "https://", "mailto:", "ftp://")


def _prose(text: str, spans: bool = False) -> list[str]:
    """The file's lines outside fenced code blocks (blank inside them), inline code spans blanked
    unless ``spans`` (a heading's anchor keeps their text)."""
    out, fence = [], None
    for line in text.splitlines():
        m = re.match(r"^\s*(`{3,}|~{3,})", line)
        if m:
            if fence is None:
                fence = m.group(1)
            elif m.group(1).startswith(fence):
                fence = None
            out.append("")
            continue
        out.append("" if fence else line if spans else re.sub(r"`+[^`]*`+", "``", line))
    return out


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading: its text
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """The anchors of a Markdown file's headings (a repeated heading's: ``s``, ``s-1``, ``s-2``...)."""
    out, seen = set(), {}
    for line in _prose(path.read_text(encoding="utf-8"), spans=True):
        m = HEADING.match(line)
        if m:
            s = slug(m.group(2))
            out.add(f"{s}-{seen[s]}" if s in seen else s)
            seen[s] = seen.get(s, 0) + 1
    return out


def links(path: Path) -> list[tuple[int, bool, str]]:
    """(line number, is an image, target) of every link and image in the file's prose."""
    out = []
    for no, line in enumerate(_prose(path.read_text(encoding="utf-8")), 1):
        out += [(no, bool(m.group(1)), m.group(2)) for m in LINK.finditer(line)]
        out += [(no, True, m.group(1)) for m in HTML_SRC.finditer(line)]
    return out


def broken(path: Path) -> list[str]:
    bad = []
    for no, image, target in links(path):
        if target.startswith(EXTERNAL):
            continue
        where = f"{path.relative_to(REPO)}:{no}: {target}"
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        if not dest.exists():
            bad.append(f"{where} (no such {'image' if image else 'file'})")
        elif image and not dest.is_file():
            bad.append(f"{where} (an image that is not a file)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{where} (no heading with anchor #{anchor} in {dest.relative_to(REPO)})")
    return bad


@pytest.mark.parametrize("path", DOCS, ids=[p.relative_to(REPO).as_posix() for p in DOCS])
def test_relative_links_and_images_resolve(path):
    bad = broken(path)
    assert not bad, "\n".join(bad)


def test_the_checker_sees_broken_links_and_skips_code(tmp_path, monkeypatch):
    """The checker itself: a missing file, image and anchor are reported; links in code are not."""
    monkeypatch.setattr("tests.project.test_docs_links.REPO", tmp_path)
    (tmp_path / "there.md").write_text("# A heading: with `code`, punctuation!\n\n## Twice\n## Twice\n")
    (tmp_path / "pic.png").write_bytes(b"\x89PNG")
    doc = tmp_path / "doc.md"
    doc.write_text(
        "[ok](there.md#a-heading-with-code-punctuation) [ok2](there.md#twice-1) ![ok3](pic.png)\n"
        "[ok4](https://example.com/missing) [ok5](#local)\n"
        "## Local\n"
        "[gone](missing.md) ![gone pic](nope.png) [bad anchor](there.md#nowhere) [bad local](#nowhere)\n"
        "`[in code](missing.md)`\n```\n[in a fence](missing.md)\n```\n"
    )
    bad = broken(doc)
    assert [b.split(": ", 1)[1].split(" (")[0] for b in bad] == [
        "missing.md",
        "nope.png",
        "there.md#nowhere",
        "#nowhere",
    ], bad


def _png_text(path: Path) -> dict[str, str]:
    """The tEXt chunks of a PNG file (matplotlib writes ``savefig(metadata=...)`` there)."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    out, pos = {}, 8
    while pos < len(data):
        (n,) = struct.unpack(">I", data[pos : pos + 4])
        kind, body = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + n]
        if kind == b"tEXt":
            key, _, value = body.partition(b"\0")
            out[key.decode("latin-1")] = value.decode("latin-1")
        elif kind == b"zTXt":
            key, _, rest = body.partition(b"\0")
            out[key.decode("latin-1")] = zlib.decompress(rest[1:]).decode("latin-1")
        pos += 12 + n
    return out


def test_the_layer_diagram_is_drawn_from_the_enforced_ranks():
    """docs/diagrams/layers.png (the README's picture) shows the ranks tests/project/test_layout.py enforces:
    after a change to ``RANK``, run ``python docs/diagrams/make_layers.py`` and commit the PNG."""
    import importlib.util

    from tests.project.test_layout import RANK

    spec = importlib.util.spec_from_file_location("make_layers", REPO / "docs/diagrams/make_layers.py")
    make_layers = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_layers)  # drawing needs matplotlib; reading the ranks does not
    assert make_layers.read_ranks() == RANK
    drawn = _png_text(REPO / "docs/diagrams/layers.png").get("ragkv:ranks")
    assert drawn == make_layers.ranks_signature(RANK), (
        "docs/diagrams/layers.png is stale: run `python docs/diagrams/make_layers.py` and commit it"
    )
