"""The markers that say which step a line of a shared file belongs to, and what a stage keeps.

`.ci/stages` writes every stage from them; the book's listings (`book/listings.py`) show each
chapter's code as that chapter's stage has it. The rules themselves are described at the top
of `.ci/stages`.
"""

import fnmatch
import re
import sys

COMMENT = r"(?://|#|<!--)"
END = r"\s*(?:-->)?\s*$"
# `[step NN]` marks what step NN adds; `[lab]` what only the lab needs, which no stage keeps
BLOCK_OPEN = re.compile(r"^\s*" + COMMENT + r"\s*\[(?:step (\d\d)|(lab))\]" + END)
BLOCK_CLOSE = re.compile(r"^\s*" + COMMENT + r"\s*\[/(?:step (\d\d)|(lab))\]" + END)
INLINE = re.compile(r"\s*" + COMMENT + r"\s*\[(?:step (\d\d)|(lab))\]" + END)
ANY_MARKER = re.compile(r"\[/?(?:step \d\d|lab)\]")
# what the lab's lines count as: a step after every stage
LAB = 100
LAB_DIR = "lab/"
MANIFEST = ".ci/stages.txt"
# the files that explain the markers, and so hold examples of them
UNMARKED = {".ci/stages", ".ci/markers.py", "book/listings.py", MANIFEST}


def is_text(data):
    return b"\0" not in data[:8192]


def read_manifest(contents):
    """Whole-file rules `(step, glob)` and line rules `(step, glob, text)`."""
    rules, line_rules = [], []
    for n, line in enumerate(contents.decode().splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        step, _, rest = line.partition(" ")
        pattern, _, text = rest.strip().partition(" ")
        if not re.fullmatch(r"\d\d", step) or not pattern:
            sys.exit(f"{MANIFEST}:{n}: expected 'NN path-or-glob [text]', got {line!r}")
        if text.strip():
            line_rules.append((int(step), pattern, text.strip()))
        else:
            rules.append((int(step), pattern))
    return rules, line_rules


def line_steps(path, line_rules):
    """The (step, text) of each line rule for this file."""
    return [(step, text) for step, pattern, text in line_rules if fnmatch.fnmatchcase(path, pattern)]


def drop_lines(text, stage, rules):
    """The lines of `text` that stage `stage` keeps under these line rules. A run of dropped
    lines between two blank lines takes the second with it (a flag's block in a --help)."""
    kept, dropping = [], False
    for line in text.split("\n"):
        if any(step > stage and needle in line for step, needle in rules):
            dropping = True
            continue
        if dropping and not line.strip() and kept and not kept[-1].strip():
            dropping = False
            continue
        dropping = False
        kept.append(line)
    return "\n".join(kept)


def owner(path, rules):
    """The step a whole file belongs to (0: every stage): the manifest's first matching
    pattern, else the step folder or chapter the path is in. The manifest comes first, so a
    later step can add a whole file to an earlier step's crate. The lab is no stage's."""
    if path.startswith(LAB_DIR):
        return LAB
    for step, pattern in rules:
        if fnmatch.fnmatchcase(path, pattern):
            return step
    m = re.match(r"steps/(\d\d)-[^/]+/", path) or re.match(r"book/src/(\d\d)-[^/]+\.md$", path)
    if m:
        return int(m.group(1))
    return 0


def strip(path, text, stage, steps):
    """The lines of `text` that stage `stage` keeps, markers removed."""
    out, open_blocks = [], []
    for n, line in enumerate(text.split("\n"), 1):
        where = f"{path}:{n}"
        if m := BLOCK_OPEN.match(line):
            step = marker_step(m, steps, where)
            open_blocks.append(step)
            continue
        if m := BLOCK_CLOSE.match(line):
            step = marker_step(m, steps, where)
            if not open_blocks or open_blocks[-1] != step:
                sys.exit(f"{where}: {m.group().strip()} closes no open block of its own")
            open_blocks.pop()
            continue
        step = max(open_blocks, default=0)
        if m := INLINE.search(line):
            step = max(step, marker_step(m, steps, where))
            line = line[: m.start()]
        elif ANY_MARKER.search(line):
            sys.exit(f"{where}: a step marker must end its line or stand alone on one: {line!r}")
        if step <= stage:
            out.append(line)
    if open_blocks:
        sys.exit(f"{path}: a [step NN] or [lab] block is never closed")
    return "\n".join(out)


def marker_step(m, steps, where):
    """The step a marker's lines belong to: its number, or LAB for `[lab]`."""
    if m.group(2):
        return LAB
    step = int(m.group(1))
    if step not in steps:
        sys.exit(f"{where}: [step {step:02}] names no step of this repository")
    return step


def marked_steps(text):
    return {int(s) for s in re.findall(r"\[/?step (\d\d)\]", text)}


def stage_text(path, text, stage, steps, line_rules):
    """`text` (the file at `path`) as stage `stage` has it: lines of later steps and of the lab
    dropped, markers removed, the manifest's line rules applied."""
    return drop_lines(strip(path, text, stage, steps), stage, line_steps(path, line_rules))
