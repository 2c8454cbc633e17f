#!/usr/bin/env python3
"""An mdBook preprocessor: each chapter's listings show the code as that chapter's stage has it.

The files a chapter includes are main's, where a shared file carries the lines of every step,
each later one marked with the step that adds it (`// [step 07]` at a line's end, or a block
between `// [step 04]` and `// [/step 04]`; see `.ci/stages`). A reader of chapter 3 has
checked out `step-03`: the listing must not hold chapter 7's lines, nor any marker. So before
mdBook's own `links` preprocessor runs, this one replaces every `{{#include path}}` and
`{{#include path:anchor}}` of a file that holds markers with the text that `.ci/stages` writes
into the chapter's stage (the same rules, from `.ci/markers.py`), cut at the anchor the way
mdBook cuts it. A chapter `NN-*.md` is stage NN; the other pages (the introduction,
Measuring) are the last stage. An include of a file without markers is left to mdBook. The
pages' own markers (a sentence of chapter 4 that names chapter 6) are removed too: the book
built from main is every step's, so those sentences stay.

mdBook runs it from the book's folder (`[preprocessor.listings]` in book.toml).
"""

import json
import re
import sys
from pathlib import Path

sys.dont_write_bytecode = True
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / ".ci"))
from markers import (  # noqa: E402  the rules of the markers, shared with .ci/stages
    ANY_MARKER, MANIFEST, read_manifest, stage_text,
)

INCLUDE = re.compile(r"\{\{#include\s+([^}:\s]+)(?::([\w_-]+))?\s*\}\}")
# mdBook's own patterns for anchors (mdbook-driver, links/take_lines.rs)
ANCHOR_START = re.compile(r"ANCHOR:\s*([\w_-]+)")
ANCHOR_END = re.compile(r"ANCHOR_END:\s*([\w_-]+)")


def anchored(text, anchor):
    """The lines between `ANCHOR: anchor` and `ANCHOR_END: anchor`, other anchors' lines left
    out: what mdBook's `take_anchored_lines` returns."""
    kept, inside = [], False
    for line in text.splitlines():
        if inside:
            if (m := ANCHOR_END.search(line)) and m.group(1) == anchor:
                break
            if not ANCHOR_START.search(line) and not ANCHOR_END.search(line):
                kept.append(line)
        elif (m := ANCHOR_START.search(line)) and m.group(1) == anchor:
            inside = True
    return "\n".join(kept)


def stage_of(chapter_path, last):
    m = re.match(r"(\d\d)-", Path(chapter_path).name)
    return int(m.group(1)) if m else last


def expand(content, chapter_dir, stage, steps, line_rules):
    def replace(m):
        path, anchor = m.group(1), m.group(2)
        file = (chapter_dir / path).resolve()
        try:
            text = file.read_text()
        except (OSError, UnicodeDecodeError):
            return m.group(0)  # mdBook reports what it cannot read
        if not ANY_MARKER.search(text):
            return m.group(0)
        text = stage_text(str(file.relative_to(ROOT)), text, stage, steps, line_rules)
        return anchored(text, anchor) if anchor else "\n".join(text.splitlines())

    return INCLUDE.sub(replace, content)


def chapters(items):
    for item in items:
        if isinstance(item, dict) and "Chapter" in item:
            yield item["Chapter"]
            yield from chapters(item["Chapter"]["sub_items"])


def main():
    if len(sys.argv) > 1:  # `listings.py supports <renderer>`: every renderer
        sys.exit(0)
    context, book = json.load(sys.stdin)
    src = Path(context["root"]) / context["config"]["book"].get("src", "src")
    steps = sorted(int(p.name[:2]) for p in (ROOT / "steps").glob("[0-9][0-9]-*")
                   if int(p.name[:2]) > 0)
    manifest = ROOT / MANIFEST
    _, line_rules = read_manifest(manifest.read_bytes() if manifest.exists() else b"")
    for chapter in chapters(book["items"]):
        if chapter.get("path"):
            stage = stage_of(chapter["path"], steps[-1])
            chapter_dir = (src / chapter["path"]).parent
            # the page itself is main's, every step's sentences kept, its markers removed
            path = str((src / chapter["path"]).resolve().relative_to(ROOT))
            content = stage_text(path, chapter["content"], steps[-1], steps, line_rules)
            chapter["content"] = expand(content, chapter_dir, stage, steps, line_rules)
    json.dump(book, sys.stdout)


if __name__ == "__main__":
    main()
