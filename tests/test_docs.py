"""Every code block in the README and in docs/ runs, or says it is a fragment.

A fenced block is one of:

* a ``python`` block: a whole script, run here as a child process, on the
  host backend (``GPUSHARE_BACKEND=host``) and, marked ``gpu``, on the
  default device (GPU 0 where there is one);
* a block whose opening fence comes right after a ``<!-- fragment -->`` line
  (shell commands, code that needs a model, a cluster or a second GPU, parts
  of a script): shown, never run;
* a ``mermaid`` block: a diagram.

Anything else fails ``test_every_block_runs_or_is_a_fragment``.
"""

from __future__ import annotations

import importlib
import importlib.util
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import ROOT, subprocess_env

FRAGMENT = "<!-- fragment -->"
_FENCE = re.compile(r"^(?P<indent>\s*)(?P<fence>`{3,}|~{3,})\s*(?P<info>[^`]*)$")
# third-party packages a block may import; a block that needs one that is missing skips
_OPTIONAL = ("torch", "ray", "cupy", "numba", "jax")
#: gpushare's modules that need an optional package: a block importing one needs that package.
_GPUSHARE_NEEDS = {"gpushare.torch": "torch", "gpushare.ray": "ray"}


@dataclass(frozen=True)
class Block:
    path: str  # relative to the repository root
    line: int  # 1-based line of the opening fence
    lang: str
    fragment: bool
    code: str

    @property
    def id(self) -> str:
        return f"{self.path}:{self.line}"


def _blocks(path: Path, rel: str | None = None) -> list[Block]:
    lines = path.read_text(encoding="utf-8").splitlines()
    rel = rel or path.relative_to(ROOT).as_posix()
    found: list[Block] = []
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if m is None:
            i += 1
            continue
        indent, fence = m["indent"], m["fence"]
        lang = (m["info"].split() or [""])[0].strip("{}.")
        before = next((lines[j].strip() for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        body: list[str] = []
        j = i + 1
        while j < len(lines) and not (
            lines[j].strip().startswith(fence[0] * len(fence)) and lines[j].strip().strip(fence[0]) == ""
        ):
            body.append(lines[j][len(indent) :] if lines[j].startswith(indent) else lines[j].lstrip())
            j += 1
        found.append(Block(rel, i + 1, lang, before == FRAGMENT, "\n".join(body) + "\n"))
        i = j + 1
    return found


def _pages() -> list[Path]:
    root = Path(ROOT)
    return [root / "README.md", *sorted((root / "docs").rglob("*.md"))]


ALL_BLOCKS = [b for page in _pages() for b in _blocks(page)]
RUNNABLE = [b for b in ALL_BLOCKS if not b.fragment and b.lang in ("python", "py")]


def test_the_pages_have_blocks() -> None:
    """The parser finds the README's blocks (an empty list would make every other test vacuous)."""
    readme = [b for b in ALL_BLOCKS if b.path == "README.md"]
    assert readme and not readme[0].fragment and readme[0].lang == "python", readme[:1]


def test_every_block_runs_or_is_a_fragment() -> None:
    unmarked = [
        f"{b.id} ({b.lang or 'no language'})"
        for b in ALL_BLOCKS
        if not b.fragment and b.lang not in ("python", "py", "mermaid")
    ]
    assert not unmarked, (
        f"these blocks are neither a runnable python script nor marked: put a {FRAGMENT} line right "
        f"before the opening fence, or make them python scripts: {unmarked}"
    )


def test_the_parser_reads_fragments_and_indented_fences(tmp_path: Path) -> None:
    page = tmp_path / "probe.md"
    page.write_text(f"# t\n\n{FRAGMENT}\n```sh\nmake demo\n```\n\n1. a step\n\n    ```python\n    print(1)\n    ```\n")
    blocks = _blocks(page, "probe.md")
    assert [(b.lang, b.fragment, b.code) for b in blocks] == [
        ("sh", True, "make demo\n"),
        ("python", False, "print(1)\n"),
    ]


def _needs(block: Block) -> list[str]:
    """The optional packages ``block`` imports, itself or through a gpushare module that needs one."""
    modules = set(re.findall(r"^\s*(?:import|from)\s+([\w.]+)", block.code, re.M))
    needed = {name.split(".")[0] for name in modules} & set(_OPTIONAL)
    for module in modules:
        needed |= {package for prefix, package in _GPUSHARE_NEEDS.items() if (module + ".").startswith(prefix + ".")}
    return sorted(needed)


def test_a_block_that_imports_gpushare_torch_needs_torch() -> None:
    code = "from gpushare.torch import bind\nimport gpushare.ray\nimport numpy\n"
    block = Block("probe.md", 1, "python", False, code)
    assert _needs(block) == ["ray", "torch"]


def _run_block(block: Block, tmp_path: Path, backend: str | None) -> None:
    for name in _needs(block):
        if importlib.util.find_spec(name) is None:
            pytest.skip(f"{block.id} imports {name}, which is not installed")
    env = subprocess_env()
    env.pop("GPUSHARE_BACKEND", None)
    if backend is not None:
        env["GPUSHARE_BACKEND"] = backend
    script = tmp_path / "block.py"
    script.write_text(block.code)
    try:
        out = subprocess.run(
            [sys.executable, str(script)],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=150,
            env=env,
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{block.id} did not finish in {exc.timeout} s")
    assert out.returncode == 0, f"{block.id} exited with {out.returncode}:\n{out.stdout}\n{out.stderr}"
    assert "Traceback" not in out.stderr, f"{block.id} printed a traceback:\n{out.stderr}"


@pytest.mark.parametrize("block", RUNNABLE, ids=[b.id for b in RUNNABLE])
def test_block_runs_on_the_host_backend(block: Block, tmp_path: Path) -> None:
    _run_block(block, tmp_path, "host")


_GPU_BLOCKS = [b for b in RUNNABLE if "ray" not in _needs(b)]  # Ray is not on the GPU machine


@pytest.mark.gpu
@pytest.mark.parametrize("block", _GPU_BLOCKS, ids=[b.id for b in _GPU_BLOCKS])
def test_block_runs_on_the_default_device(block: Block, tmp_path: Path) -> None:
    _run_block(block, tmp_path, None)


def _documented() -> set[str]:
    pages = (Path(ROOT) / "docs" / "reference").glob("*.md")
    return {m for page in pages for m in re.findall(r"^::: ([\w.]+)\s*$", page.read_text(), re.M)}


@pytest.mark.parametrize("module", ["gpushare", "gpushare.torch", "gpushare.ray"])
def test_the_reference_covers_every_public_name(module: str) -> None:
    """The API reference is generated from docstrings; this keeps its list of names whole."""
    import multiprocessing

    if module == "gpushare.torch":
        pytest.importorskip("torch")
    mod = importlib.import_module(module)
    own = [n for n in mod.__all__ if module != "gpushare" or n not in multiprocessing.__all__]
    missing = sorted(f"{module}.{n}" for n in own if f"{module}.{n}" not in _documented())
    assert not missing, f"add these to a page under docs/reference/: {missing}"


#: What a work log says and a user page must not: a launch's time of day, and the phrases of a
#: lab notebook. A kernel launch ("one launch per 96") is the software's own word and stays.
_LAB_NOTES = re.compile(
    r"\(\d{1,2}:\d{2}\)|\b\d{1,2}:\d{2} run\b|\bat \d{1,2}:\d{2}\b|since then|earlier run|"
    r"\b(?:two|three|four|five|alternating|both|every|several|\d+) launch(?:es)?\b|launch's",
    re.IGNORECASE,
)


def test_user_pages_hold_no_lab_notes() -> None:
    # The pages tell what the software does and what was measured (device, date, command); the
    # record of runs lives in the development folder.
    root = Path(ROOT)
    pages = [root / "README.md", *sorted((root / "docs").rglob("*.md"))]
    found = []
    for page in pages:
        for number, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
            match = _LAB_NOTES.search(line)
            if match:
                found.append(f"{page.relative_to(root)}:{number}: {match.group(0)!r} in {line.strip()!r}")
    assert not found, "lab notes on user pages:\n" + "\n".join(found)


def test_the_lab_note_check_catches_what_it_names() -> None:
    for text in ("in the 05:51 run", "In an earlier run (05:37)", "two launches on one H100", "since then",
                 "every launch's figures"):  # fmt: skip
        assert _LAB_NOTES.search(text), text
    for text in ("one launch per 96 tensors", "2026-11-29 05:51, `python -m bench`", "a kernel launch"):
        assert not _LAB_NOTES.search(text), text


# -- the contributors' map and its notes ------------------------------------------------------

#: The map's length: a map, not the reasoning (which is the notes').
MAP_WORDS = 4000
#: A source comment that names a section of the map or the notes: the file, then the section's
#: title in quotes, after a comma or in parentheses, perhaps on the comment's next line.
_SECTION_REF = re.compile(r'dev/(design(?:-notes)?\.md)(?:,|\s*\()\s*(?:#\s*)?"([^"]+)"')


def _headings(page: Path) -> set[str]:
    return {line.lstrip("#").strip() for line in page.read_text(encoding="utf-8").splitlines() if line.startswith("#")}


def test_the_design_map_is_a_map_outside_the_user_guide() -> None:
    root = Path(ROOT)
    words = len((root / "dev" / "design.md").read_text(encoding="utf-8").split())
    assert words <= MAP_WORDS, f"dev/design.md has {words} words: the reasoning belongs in dev/design-notes.md"
    assert not (root / "docs" / "design.md").exists(), "the contributors' map lives in dev/, not in the user guide"
    assert "design" not in (root / "mkdocs.yml").read_text(encoding="utf-8"), "the user guide's nav names a design page"


def test_every_source_reference_to_the_design_pages_names_a_section_they_have() -> None:
    root = Path(ROOT)
    headings = {name: _headings(root / "dev" / name) for name in ("design.md", "design-notes.md")}
    refs = 0
    bad = []
    for path in sorted((root / "gpushare").rglob("*")):
        if path.suffix not in (".py", ".c"):
            continue
        for name, title in _SECTION_REF.findall(path.read_text(encoding="utf-8")):
            refs += 1
            if title not in headings[name]:
                bad.append(f"{path.relative_to(root)}: dev/{name} has no section {title!r}")
    assert refs >= 30, f"only {refs} references found: the pattern no longer reads the source's comments"
    assert not bad, "\n".join(bad)
