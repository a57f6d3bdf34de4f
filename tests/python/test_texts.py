"""The repository speaks of what a reader can open and run: the files its docstrings, comments, help
texts, README and docs cite are in the repository (by path from the root, from the citing file's
folder, or from python/), the code names no section numbers of documents, and nothing ties it to how
the project was developed or to one remote setup."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FILES = sorted(p for folder in ("python", "scripts", "configs", "csrc", "tests", "cmake", ".ci")
               for p in (ROOT / folder).rglob("*")
               if p.is_file() and p.suffix in (".py", ".sh", ".toml", ".h", ".cuh", ".cu", ".cpp", "")
               and p.name != Path(__file__).name and "__pycache__" not in p.parts)
# A path from a top-level folder, or a bare document or source file name (files a run writes, such as
# latest.json, are not citations).
CITATION = re.compile(r"(?<![\w./-])((?:(?:bench|docs|configs|scripts|tests|python|csrc|cmake)/[\w./-]*\w\.\w+)"
                      r"|[\w-]+\.(?:md|py|cpp|cu|cuh|h))\b")
C_COMMENT = re.compile(r"//[^\n]*|/\*.*?\*/", re.S)
BASES = (ROOT, ROOT / "csrc")
# How the project is developed: neither the code nor the documents name it.
_WORKFLOW = r"\bsessions?\b|device (?:tool|run)|H200 machine|ANCHORS|KERNEL_NOTES|(?-i:\$OUT\b)"
WORKFLOW = re.compile(_WORKFLOW, re.IGNORECASE)
# The code also names no remote setup, no section numbers, and docs/DESIGN.md by its path.
FORBIDDEN = re.compile(_WORKFLOW + r"|\bcarry\b|\.md §|(?<![\w/])DESIGN(?:\.md)?\b", re.IGNORECASE)


def _text(path: Path) -> str:
    """What a reader reads: the whole file, or the comments of C++/CUDA (whose includes are checked by the build)."""
    text = path.read_text()
    return "\n".join(C_COMMENT.findall(text)) if path.suffix in (".h", ".cuh", ".cu", ".cpp") else text


def _cited(path: Path) -> list[str]:
    return CITATION.findall(_text(path))


NAMES = {p.name for folder in ("python", "csrc", "docs", "scripts", "tests") for p in (ROOT / folder).rglob("*")}


def _exists(cited: str, citing: Path) -> bool:
    """A path from a top-level folder (or the citing file's) must exist; a bare name must be some file's."""
    if "/" not in cited:
        return cited in NAMES or (ROOT / cited).exists()
    return any((base / cited).exists() for base in (citing.parent, *BASES))


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_cited_files_exist(path):
    missing = [c for c in _cited(path) if not _exists(c, path)]
    assert not missing, f"{path.relative_to(ROOT)} cites files the repository does not hold: {missing}"


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_section_numbers_or_development_setup(path):
    found = FORBIDDEN.findall(_text(path))
    assert not found, f"{path.relative_to(ROOT)}: {found}"


DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


@pytest.mark.parametrize("path", DOCUMENTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_documents_cite_files_that_exist_and_no_workflow(path):
    """The README and docs/ speak to users: the files they name are in the repository, and they name
    nothing of how the project is developed."""
    text = path.read_text()
    missing = [c for c in CITATION.findall(text) if not _exists(c, path)]
    assert not missing, f"{path.relative_to(ROOT)} cites files the repository does not hold: {missing}"
    assert not WORKFLOW.findall(text), f"{path.relative_to(ROOT)}: {WORKFLOW.findall(text)}"


def test_the_patterns_find_what_they_look_for():
    """A guard against patterns that match nothing."""
    cited = {c for p in FILES for c in _cited(p)}
    assert {"docs/DESIGN.md", "exchange.py", "epilogue.cuh"} <= cited
    assert "docs/DESIGN.md" in CITATION.findall((ROOT / "README.md").read_text())
    assert WORKFLOW.search("in the last session") and not WORKFLOW.search("an obsession")
    assert FORBIDDEN.search("as in session 12") and FORBIDDEN.search("see DESIGN.md") \
        and not FORBIDDEN.search("see docs/DESIGN.md")
