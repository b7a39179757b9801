"""The docs name only what exists: every file path, result file, module and in-repo link that README.md
and docs/*.md mention is checked against the tree, so a rename or a deleted result breaks CI, not a
reader. The scanners are tested on small texts too, so a scanner that finds nothing cannot pass."""

from __future__ import annotations

import fnmatch
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
CHECKED_DIRS = ("src/", "benchmarks/", "tests/", "tests_gpu/", "docs/")
CODE_SUFFIXES = (".py", ".cu", ".c", ".sh")
# Files of a Hugging Face checkpoint directory: named in docs, never part of this tree.
CHECKPOINT_FILES = {"config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json",
                    "special_tokens_map.json", "model.safetensors.index.json"}

# A path-like token: letters, digits, _ . - / * and ending in a file suffix we track.
PATH_RE = re.compile(r"(?<![\w./*-])((?:\.\./)*[\w*][\w.*/-]*\.(?:py|cu|c|sh|md|json|log|toml))(?![\w/])")
MODULE_RE = re.compile(r"\bdraftrelay(?:\.[A-Za-z_]\w*)+")
LINK_RE = re.compile(r"\]\(([^)\s]+)\)")


def doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def tree_files() -> list[str]:
    skip = {".git", "__pycache__", ".pytest_cache", ".ruff_cache"}
    out = []
    for p in ROOT.rglob("*"):
        rel = p.relative_to(ROOT)
        if p.is_file() and not skip.intersection(rel.parts) and not rel.parts[0].startswith(".stage"):
            out.append(rel.as_posix())
    return out


def placeholder(token: str) -> bool:
    """DIR/x.json, tp2_step_<shapes>.json, probe_{step}.json: a pattern, not a name."""
    return any(c in token for c in "<>{}") or token.startswith(("DIR/", "OUT/", "$"))


def missing_paths(text: str, files: list[str]) -> list[str]:
    """The path-like tokens of `text` that name nothing in `files` (paths relative to the repo root)."""
    fileset = set(files)
    results = [f[len("benchmarks/results/"):] for f in files if f.startswith("benchmarks/results/")]
    basenames = {f.rsplit("/", 1)[-1] for f in files}
    bad = []
    for token in PATH_RE.findall(text):
        if placeholder(token):
            continue
        name = token.rsplit("/", 1)[-1]
        if token.startswith("DIR/") or token.startswith("OUT/"):
            continue
        if token.startswith(CHECKED_DIRS) or token.startswith("benchmarks/results/"):
            if "*" in token:
                ok = any(fnmatch.fnmatch(f, token) for f in files)
            else:
                ok = token in fileset
        elif token.endswith(".json") and "/" not in token:
            # a bare result name: it must be a kept result (or a checkpoint's file)
            if token in CHECKPOINT_FILES:
                continue
            ok = any(fnmatch.fnmatch(r, token) for r in results)
        elif "/" in token:
            # relative to a part of the package (handoff/rounds.py, ../wire/roundfn.py, draftrelay/...)
            tail = token.lstrip("./")
            if "*" in tail:
                ok = any(fnmatch.fnmatch(f, "*" + tail) for f in files)
            else:
                ok = any(f == tail or f.endswith("/" + tail) for f in files)
        elif token.endswith(CODE_SUFFIXES):
            ok = name in basenames  # a bare module file named in a table whose header gives the folder
        else:
            continue
        if not ok:
            bad.append(token)
    return bad


def module_exists(dotted: str) -> bool:
    """draftrelay.a.b[.attr]: the longest module prefix must exist and reach past `draftrelay`, and a
    remaining first attribute must be defined or imported in that module."""
    parts = dotted.split(".")
    for n in range(len(parts), 1, -1):
        base = ROOT / "src" / Path(*parts[:n])
        for mod in (base.with_suffix(".py"), base / "__init__.py"):
            if mod.is_file():
                rest = parts[n:]
                if not rest:
                    return True
                return re.search(rf"\b{re.escape(rest[0])}\b", mod.read_text()) is not None
    return False


def heading_anchors(md: str) -> set[str]:
    anchors = set()
    for line in md.splitlines():
        m = re.match(r"#+\s+(.*)", line)
        if m:
            a = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
            anchors.add(a)
    return anchors


def broken_links(text: str, here: Path) -> list[str]:
    bad = []
    prose = re.sub(r"`[^`\n]*`", "", re.sub(r"```.*?```", "", text, flags=re.S))  # code is not a link
    for target in LINK_RE.findall(prose):
        if re.match(r"[a-z]+:", target):
            continue  # http:, mailto:
        path, _, anchor = target.partition("#")
        dest = (here.parent / path).resolve() if path else here
        if not dest.exists():
            bad.append(target)
        elif anchor and dest.suffix == ".md" and anchor not in heading_anchors(dest.read_text()):
            bad.append(target)
    return bad


# -- the scanners themselves -------------------------------------------------------------------------

def test_path_scanner_finds_missing_and_accepts_present():
    files = ["src/draftrelay/handoff/rounds.py", "benchmarks/results/tp2_step.json",
             "benchmarks/results/drills_emulated.json", "docs/ENGINE.md", "tests_gpu/p2p_probe.py"]
    text = ("`src/draftrelay/handoff/rounds.py`, `src/draftrelay/handoff/gone.py`, `handoff/rounds.py`, "
            "`handoff/old.py`, `rounds.py`, `missing.py`, `tp2_step.json`, `tp2_step_b.json`, "
            "`benchmarks/results/drills_emulated*.json`, `benchmarks/results/nothing_*.json`, "
            "DIR/tp2_probe.json, `tp2_step_<shapes>.json`, config.json, docs/ENGINE.md, docs/GONE.md, "
            "`python tests_gpu/p2p_probe.py --out DIR`, ../round.py")
    assert missing_paths(text, files) == ["src/draftrelay/handoff/gone.py", "handoff/old.py", "missing.py",
                                          "tp2_step_b.json", "benchmarks/results/nothing_*.json",
                                          "docs/GONE.md", "../round.py"]


def test_module_and_anchor_scanners():
    assert module_exists("draftrelay.handoff.rounds")
    assert module_exists("draftrelay.round.Rounds")
    assert not module_exists("draftrelay.handoff.collectives")
    assert not module_exists("draftrelay.round.NoSuchThing")
    assert "measured-emulated-stream" in heading_anchors("## Measured (emulated stream)\n")
    assert broken_links("[x](docs/ORDERING.md#resets) [y](docs/ORDERING.md#nope) [z](docs/NOPE.md) "
                        "`k[grid](a)`\n```\nk[grid](b)\n```", ROOT / "README.md") == ["docs/ORDERING.md#nope",
                                                                                    "docs/NOPE.md"]


# -- the docs ----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def files() -> list[str]:
    return tree_files()


@pytest.mark.parametrize("doc", doc_files(), ids=lambda p: p.name)
def test_doc_names_only_existing_files(doc, files):
    assert missing_paths(doc.read_text(), files) == [], f"{doc.name} names files that do not exist"


@pytest.mark.parametrize("doc", doc_files(), ids=lambda p: p.name)
def test_doc_names_only_existing_modules(doc):
    bad = sorted({m for m in MODULE_RE.findall(doc.read_text()) if not module_exists(m)})
    assert bad == [], f"{doc.name} names modules that do not exist"


@pytest.mark.parametrize("doc", doc_files(), ids=lambda p: p.name)
def test_doc_links_resolve(doc):
    assert broken_links(doc.read_text(), doc) == [], f"{doc.name} has links to nothing"


# Development history belongs in commit messages; the docs describe the present.
HISTORY_RE = re.compile(r"\b20\d\d-\d\d-\d\d\b|\bissue #?\d+|\bcommit [0-9a-f]{7,40}\b|\bsecond run\b|"
                        r"\bsuperseded\b|\bprevious (?:build|session|run)\b|\b(?:first|second|last) (?:GPU )?session\b",
                        re.IGNORECASE)


def test_history_scanner():
    text = ("measured 2026-11-29; see issue 6; commit 15c4fd7; the second run; superseded; the previous build;\n"
            "in the first GPU session; not known to this session; the path issues 27 kernels; seeded weights")
    assert [m.group(0) for m in HISTORY_RE.finditer(text)] == [
        "2026-11-29", "issue 6", "commit 15c4fd7", "second run", "superseded", "previous build",
        "first GPU session"]


@pytest.mark.parametrize("doc", doc_files(), ids=lambda p: p.name)
def test_doc_has_no_development_history(doc):
    hits = [m.group(0) for m in HISTORY_RE.finditer(doc.read_text())]
    assert hits == [], f"{doc.name} tells history"


def test_every_kept_result_is_cited():
    """benchmarks/results/ holds the current result of each benchmark: a file no doc cites is a
    superseded run (git keeps it) or an uncited claim."""
    text = "\n".join(p.read_text() for p in doc_files())
    cited = set()
    for token in PATH_RE.findall(text):
        if token.endswith((".json", ".log")):
            cited.update(r.name for r in RESULTS.iterdir() if fnmatch.fnmatch(r.name, token.rsplit("/", 1)[-1]))
    uncited = sorted(r.name for r in RESULTS.iterdir() if r.suffix in (".json", ".log") and r.name not in cited)
    assert uncited == [], "results no doc cites"
