"""Every repository path the docs name exists.

The docs (README.md and docs/**/*.md) point readers at files: `operator/gpufleet/planning/`, a test to run,
a sample to apply, [a link](docs/router.md). When a file moves or is removed, the doc that names it goes
stale without anyone noticing. This test reads every doc and fails naming each path that no longer exists,
with the doc and line that names it.

What counts as a path:

- a word inside an inline code span (`...`; fenced code blocks are skipped) whose first component is one of
  the repository's top-level entries (the root listing at test time, less `.git` and what the root
  .gitignore ignores): `bench/operator_scale.py`, `pyproject.toml`, `tests/engine/test_pd.py::test_x`.
  These resolve against the repository root.
- the target of a markdown link, inline `[text](target)` or a reference definition `[label]: target`,
  resolved against the doc's own folder.

A trailing `:line` (or `:first-last`), `::test_name`, `#anchor` and trailing punctuation are dropped; `*`,
`?` and `[...]` match as a glob, and a placeholder such as `<AlertName>` matches as `*`. Absolute paths,
URLs and paths under `~/` are not checked.
"""
from __future__ import annotations

import fnmatch
import glob
import os
import posixpath
import re
from pathlib import Path
from typing import NamedTuple
from urllib.parse import unquote

ROOT = Path(__file__).resolve().parents[2]

FENCE = re.compile(r"^ {0,3}(?:[-*+] +|\d+[.)] +)*(`{3,}|~{3,})")
CODE_SPAN = re.compile(r"(?<!`)(`+)(?!`)(.+?)(?<!`)\1(?!`)", re.DOTALL)
# Words inside a code span: split on blanks and on what separates a path from a flag, a key or a list.
WORD = re.compile(r"[^\s=,'\"()\[\]{}|;]+")
INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*(<[^>\n]*>|[^\s()]+(?:\([^\s()]*\)[^\s()]*)*)"
                         r"(?:\s+(?:\"[^\"]*\"|'[^']*'))?\s*\)")
LINK_DEFINITION = re.compile(r"^ {0,3}\[[^\]\n]+\]:\s*(<[^>\n]*>|\S+)", re.MULTILINE)
SUFFIX = re.compile(r"(?:::.*|#.*|:\d+(?:-\d+)?)$")
PLACEHOLDER = re.compile(r"<[^<>/]*>")
TRAILING = ".,;:!?)'\"`>"
GLOB_CHARS = re.compile(r"[*?\[]")


class PathRef(NamedTuple):
    path: str       # relative to the repository root, POSIX separators; may be a glob
    line: int       # 1-based line of the doc that names it
    written: str    # as the doc writes it


def top_level_entries(root: Path = ROOT) -> frozenset[str]:
    """The root listing, less `.git` and what the root .gitignore names (`.venv/`, `/reports/`, ...)."""
    ignored: list[str] = [".git"]
    gitignore = root / ".gitignore"
    if gitignore.is_file():
        for raw in gitignore.read_text(encoding="utf-8").splitlines():
            pattern = raw.strip()
            if not pattern or pattern.startswith(("#", "!")):
                continue
            pattern = pattern.strip("/")
            if "/" not in pattern:
                ignored.append(pattern)
    return frozenset(name for name in os.listdir(root)
                     if not any(fnmatch.fnmatchcase(name, pattern) for pattern in ignored))


def _blank_fenced_blocks(text: str) -> str:
    """The text with every fenced code block's lines emptied (line numbers kept)."""
    out, fence = [], None
    for line in text.split("\n"):
        opened = FENCE.match(line)
        if fence is None:
            if opened:
                fence = opened.group(1)
                out.append("")
                continue
            out.append(line)
        else:
            out.append("")
            if opened and opened.group(1)[0] == fence[0] and len(opened.group(1)) >= len(fence) \
                    and not line[opened.end():].strip():
                fence = None
    return "\n".join(out)


def _clean(word: str) -> str:
    word = word.strip()
    while True:
        before = word
        word = word.rstrip(TRAILING)
        word = SUFFIX.sub("", word)
        if word == before:
            return word


def _line_at(text: str, offset: int) -> int:
    return text.count("\n", 0, offset) + 1


def extract_paths(markdown: str, doc: str, top: frozenset[str]) -> list[PathRef]:
    """The repository paths a markdown document names. `doc` is its path from the repository root
    (links resolve against its folder); `top` the repository's top-level entries."""
    text = _blank_fenced_blocks(markdown)
    refs: list[PathRef] = []
    spans: list[tuple[int, int]] = []
    for span in CODE_SPAN.finditer(text):
        if "\n\n" in span.group(2):       # a lone backtick, not a span: code spans end with their paragraph
            continue
        spans.append(span.span())
        for word in WORD.finditer(span.group(2)):
            written = word.group(0)
            if "://" in written or written.startswith(("~", "/")):
                continue
            path = _clean(written.removeprefix("./"))
            if not path or path.split("/", 1)[0] not in top:
                continue
            refs.append(PathRef(PLACEHOLDER.sub("*", path), _line_at(text, span.start(2) + word.start()), written))

    def in_span(offset: int) -> bool:
        return any(start <= offset < end for start, end in spans)

    folder = posixpath.dirname(doc)
    for pattern in (INLINE_LINK, LINK_DEFINITION):
        for link in pattern.finditer(text):
            if in_span(link.start()):
                continue
            written = link.group(1).strip("<>")
            if (not written or "://" in written or written.startswith(("#", "/", "~", "mailto:"))
                    or re.match(r"^[a-z][a-z0-9+.-]*:", written)):
                continue
            target = unquote(written.split("#", 1)[0].split("?", 1)[0])
            if not target:
                continue
            path = posixpath.normpath(posixpath.join(folder, target))
            if target.endswith("/"):
                path += "/"
            refs.append(PathRef(path, _line_at(text, link.start(1)), written))
    return sorted(refs, key=lambda ref: ref.line)


def exists(path: str, root: Path = ROOT) -> bool:
    if path == ".." or path.startswith("../"):     # a link out of the repository
        return False
    if GLOB_CHARS.search(path):
        return bool(glob.glob(path, root_dir=root))
    return os.path.exists(root / path)


def docs(root: Path = ROOT) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").rglob("*.md"))]


def test_every_repository_path_the_docs_name_exists():
    top = top_level_entries()
    missing = []
    for doc in docs():
        name = doc.relative_to(ROOT).as_posix()
        for ref in extract_paths(doc.read_text(encoding="utf-8"), name, top):
            if not exists(ref.path):
                shown = ref.path if ref.path == ref.written else f"{ref.path} (written `{ref.written}`)"
                missing.append(f"  {name}:{ref.line}: {shown}")
    assert not missing, (f"{len(missing)} repository path(s) named in the docs do not exist; "
                         "update the doc or restore the file:\n" + "\n".join(missing))


SAMPLE = """\
# A doc

Run `bench/operator_scale.py --n 1000` or `.venv/bin/python bench/autoscaler_latency.py`;
the pin is in `operator/gpufleet/api/engine_release.py:12`, tested by
`tests/engine/test_pd.py::test_a_long_prompt`, and `Makefile`'s lint target reads `pyproject.toml`.
See [the router](router.md#disaggregated-services), [the guard](../engine_image/gpufleet_engine/serving/drain.py),
[a site](https://example.com/docs/x.md), [here](#an-anchor), `~/.cache/gpufleet/bin/`, `/etc/gpufleet/guard.json`
and `reconcile/`, `docs/runbooks/<AlertName>.md` and `rules/tests/*.yaml`.
Not a span: `kubectl get
inferenceservices`.

```sh
python bench/not_checked.py
```

[ref]: runbooks/GpufleetEngineDown.md
"""


def test_extraction_finds_code_spans_links_and_strips_suffixes():
    top = frozenset({"bench", "operator", "engine_image", "tests", "docs", "rules", "Makefile", "pyproject.toml",
                     "README.md"})
    refs = extract_paths(SAMPLE, "docs/sample.md", top)
    assert [(ref.path, ref.line) for ref in refs] == [
        ("bench/operator_scale.py", 3),
        ("bench/autoscaler_latency.py", 3),
        ("operator/gpufleet/api/engine_release.py", 4),
        ("tests/engine/test_pd.py", 5),
        ("Makefile", 5),
        ("pyproject.toml", 5),
        ("docs/router.md", 6),
        ("engine_image/gpufleet_engine/serving/drain.py", 6),
        ("docs/runbooks/*.md", 8),
        ("rules/tests/*.yaml", 8),
        ("docs/runbooks/GpufleetEngineDown.md", 16),
    ]
    assert refs[2].written == "operator/gpufleet/api/engine_release.py:12"
    assert refs[3].written == "tests/engine/test_pd.py::test_a_long_prompt"


def test_a_path_that_is_gone_is_reported_and_one_that_is_there_is_not(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "here.md").write_text("x")
    (tmp_path / ".gitignore").write_text("/reports/\n.venv/\n")
    (tmp_path / "reports").mkdir()
    top = top_level_entries(tmp_path)
    assert top == {"docs", ".gitignore"}
    refs = extract_paths("`docs/here.md` and `docs/gone.md`, `reports/x.png`, [up](../../outside.md)\n",
                         "docs/a.md", top)
    assert {ref.path: exists(ref.path, tmp_path) for ref in refs} == {
        "docs/here.md": True, "docs/gone.md": False, "../outside.md": False}
