#!/usr/bin/env python3
"""Code in the docs is code the build compiles: every ```c++ / ```cpp / ```cmake block of README.md
and docs/*.md must appear, line for line (trailing spaces aside), in one of the repository's files
that the build compiles or runs (model modules, examples, tests, CMake files). A block that is only
an illustration is fenced as ```text. Every relative link ([..](docs/x.md#heading)) must name a
file that exists and, with #, one of its headings. Prints each block's source; exits 1 naming
every block found nowhere and every broken link."""
import pathlib
import re
import sys

root = pathlib.Path(__file__).resolve().parent.parent
docs = [root / "README.md", *sorted((root / "docs").glob("*.md"))]
sources = [p for pattern in ("examples/**/*.cppm", "examples/**/CMakeLists.txt", "tests/**/*.cppm", "tests/**/*.cpp",
                             "tests/**/CMakeLists.txt", "bench/*.cppm", "generators/kinds/*/traits.cppm",
                             "dsl/**/*.cppm", "cmake/*.cmake", "runtime/*.cppm", "trainer/*.cppm")
           for p in root.glob(pattern) if "build" not in p.relative_to(root).parts[:1]]
texts = {p: [line.rstrip() for line in p.read_text().splitlines()] for p in sources}
fence = re.compile(r"^```(c\+\+|cpp|cmake)\s*$")

def found_in(block):
    for path, lines in texts.items():
        for i in range(len(lines) - len(block) + 1):
            if lines[i:i + len(block)] == block:
                return path
    return None

missing = 0
checked = 0
for doc in docs:
    lines = doc.read_text().splitlines()
    i = 0
    while i < len(lines):
        if fence.match(lines[i]):
            start = i + 1
            end = next(j for j in range(start, len(lines)) if lines[j].startswith("```"))
            block = [line.rstrip() for line in lines[start:end]]
            checked += 1
            where = found_in(block)
            name = f"{doc.relative_to(root)}:{start}"
            if where:
                print(f"{name}: {len(block)} lines, from {where.relative_to(root)}")
            else:
                print(f"{name}: {len(block)} lines found in no compiled file (quote one, or fence it as text)")
                missing += 1
            i = end
        i += 1

def slug(heading):  # GitHub's anchors: lower case, punctuation dropped, spaces to dashes
    return re.sub(r"[^a-z0-9 _-]", "", heading.strip().lower()).replace(" ", "-")

broken = 0
for doc in docs:
    for target in re.findall(r"\]\(([^)\s]+)\)", doc.read_text()):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        file = (doc.parent / path).resolve() if path else doc
        ok = file.exists()
        if ok and anchor:
            ok = anchor in {slug(h) for h in re.findall(r"^#+ (.*)$", file.read_text(), re.M)}
        if not ok:
            print(f"{doc.relative_to(root)}: broken link {target}")
            broken += 1
print(f"{checked} code blocks, {missing} not from compiled files; {broken} broken links")
sys.exit(1 if missing or broken or not checked else 0)
