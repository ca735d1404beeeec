#!/usr/bin/env python3
"""Checks the README and the book (book/src) without building anything:

- every relative link (`[text](path)`, `[text](path#anchor)`, `[text](#anchor)`) names a file
  that exists, and an anchor that one of its headings produces (mdBook's ids);
- every `{{#include path:anchor}}` names a file that exists and an anchor it holds
  (mdBook fails on a missing file but not on a missing anchor);
- every listing marked `<!-- listing: path:anchor -->` in the README is followed by a code
  block equal to the lines between `ANCHOR: anchor` and `ANCHOR_END: anchor` in that file
  (a README cannot include, so CI checks that its copy is the compiled one).

- with `--pretrain-help FILE` (the output of `pretrain_gpt --help`), every option it lists
  appears in the book's `pretrain_gpt` reference (book/src/pretrain.md).

Run from anywhere: python3 .ci/check_docs.py [--pretrain-help FILE]. Exits 1 listing every
problem.
"""

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BOOK = ROOT / "book" / "src"

LINK = re.compile(r"(?<!!)\[(?:[^\]\\]|\\.)*\]\(([^()\s]+)(?:\s+\"[^\"]*\")?\)")
INCLUDE = re.compile(r"\{\{#(?:include|rustdoc_include)\s+([^}\s]+)\s*\}\}")
LISTING = re.compile(r"<!--\s*listing:\s*(\S+?)\s*-->")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
ANCHOR_LINE = re.compile(r"ANCHOR(?:_END)?:\s*(\w+)")


def strip_code(text):
    """The text with fenced code blocks and inline code blanked (lines kept)."""
    out, fenced = [], None
    for line in text.split("\n"):
        stripped = line.lstrip()
        if fenced is None and (stripped.startswith("```") or stripped.startswith("~~~")):
            fenced = stripped[:3]
            out.append("")
        elif fenced is not None:
            if stripped.startswith(fenced):
                fenced = None
            out.append("")
        elif line.startswith("    ") and not stripped.startswith(("-", "*", "|")) and out and out[-1].strip() == "":
            out.append("")  # an indented code block
        else:
            out.append(re.sub(r"`+[^`]*`+", "``", line))
    return "\n".join(out)


def heading_ids(path):
    """mdBook's ids of a page's headings (duplicates get -1, -2, ...)."""
    ids, seen = set(), {}
    for line in strip_code_keep_headings(path.read_text()).split("\n"):
        m = HEADING.match(line)
        if not m:
            continue
        text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", m.group(2))  # links: their text
        text = re.sub(r"<[^>]+>", "", text).replace("`", "").replace("*", "")
        base = "".join(
            c.lower() if c.isalnum() or c in "_-" else "-" if c.isspace() else "" for c in text
        )
        n = seen.get(base, 0)
        seen[base] = n + 1
        ids.add(base if n == 0 else f"{base}-{n}")
    return ids


def strip_code_keep_headings(text):
    """Fenced blocks removed (a `# comment` in a shell block is not a heading)."""
    out, fenced = [], None
    for line in text.split("\n"):
        stripped = line.lstrip()
        if fenced is None and (stripped.startswith("```") or stripped.startswith("~~~")):
            fenced = stripped[:3]
        elif fenced is not None:
            if stripped.startswith(fenced):
                fenced = None
        else:
            out.append(line)
    return "\n".join(out)


def anchored(path, anchor):
    """The lines between `ANCHOR: anchor` and `ANCHOR_END: anchor`, other anchor lines dropped,
    or None when the file has no such anchor."""
    lines, inside, found = [], False, False
    for line in path.read_text().split("\n"):
        m = ANCHOR_LINE.search(line)
        if m:
            if m.group(1) == anchor:
                if "ANCHOR_END" in line:
                    inside = False
                else:
                    inside, found = True, True
            continue
        if inside:
            lines.append(line)
    return "\n".join(lines) if found else None


def check_page(page, problems):
    text = page.read_text()
    where = page.relative_to(ROOT)
    body = strip_code(text)
    for number, line in enumerate(body.split("\n"), 1):
        for m in LINK.finditer(line):
            target = m.group(1)
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:, ...
                continue
            path_part, _, anchor = target.partition("#")
            dest = (page.parent / path_part).resolve() if path_part else page
            if not dest.exists():
                problems.append(f"{where}:{number}: link to {target}: no file {path_part}")
                continue
            if anchor and dest.suffix == ".md" and anchor not in heading_ids(dest):
                problems.append(f"{where}:{number}: link to {target}: no heading #{anchor}")
    for number, line in enumerate(text.split("\n"), 1):
        for m in INCLUDE.finditer(line):
            spec = m.group(1)
            file_part, _, anchor = spec.partition(":")
            dest = (page.parent / file_part).resolve()
            if not dest.is_file():
                problems.append(f"{where}:{number}: include of {spec}: no file {file_part}")
            elif anchor and not anchor[0].isdigit() and anchored(dest, anchor) is None:
                problems.append(f"{where}:{number}: include of {spec}: no anchor {anchor}")


def check_listings(page, problems):
    lines = page.read_text().split("\n")
    where = page.relative_to(ROOT)
    for number, line in enumerate(lines, 1):
        m = LISTING.search(line)
        if not m:
            continue
        file_part, _, anchor = m.group(1).partition(":")
        source = ROOT / file_part
        expected = anchored(source, anchor) if source.is_file() else None
        if expected is None:
            problems.append(f"{where}:{number}: listing {m.group(1)}: no such file or anchor")
            continue
        start = number  # the line after the marker (0-based index `number`)
        if start >= len(lines) or not lines[start].startswith("```"):
            problems.append(f"{where}:{number}: listing {m.group(1)}: no code block right after it")
            continue
        end = start + 1
        while end < len(lines) and not lines[end].startswith("```"):
            end += 1
        shown = "\n".join(lines[start + 1 : end])
        if shown.strip("\n") != expected.strip("\n"):
            problems.append(
                f"{where}:{number}: the listing differs from {m.group(1)}: copy the lines "
                f"between its ANCHOR lines into the README"
            )


def check_options(help_file, problems):
    options = set()
    for line in Path(help_file).read_text().split("\n"):
        m = re.match(r"^\s+(?:-\w, )?(--[a-z0-9][a-z0-9-]*)", line)
        if m and m.group(1) not in ("--help", "--version"):  # clap's own
            options.add(m.group(1))
    if not options:
        problems.append(f"{help_file}: no options found in pretrain_gpt's --help")
    reference = (BOOK / "pretrain.md").read_text()
    for option in sorted(options):
        if not re.search(re.escape(option) + r"(?![a-z0-9-])", reference):
            problems.append(f"book/src/pretrain.md: pretrain_gpt's option {option} is not described")


def main():
    problems = []
    if len(sys.argv) == 3 and sys.argv[1] == "--pretrain-help":
        check_options(sys.argv[2], problems)
    elif len(sys.argv) != 1:
        print("usage: check_docs.py [--pretrain-help FILE]")
        return 2
    pages = sorted(BOOK.rglob("*.md")) + [ROOT / "README.md"]
    for page in pages:
        check_page(page, problems)
    check_listings(ROOT / "README.md", problems)
    for p in problems:
        print(p)
    print(f"checked {len(pages)} pages: {len(problems)} problem(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
