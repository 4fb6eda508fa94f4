"""README.md and docs/ link to each other by relative paths and section anchors, and the code cites sections by name
(`docs/serve.md, "Limits"`): every such link and citation must land on a file and a heading that exist, so that
renaming a section or moving a file fails here instead of leaving readers at a dead link."""
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")                       # [text](target)
BARE = re.compile(r"(?<![\w/(])((?:docs/)?[a-z_]+\.md)#([a-z0-9_-]+)")    # docs/performance.md#gpu in prose
# docs/x.md, "Section" or *Section*, or an unquoted capitalised name up to the next punctuation
CITED = re.compile(r"(docs/[a-z_]+\.md),? (?:\"([^\"]+)\"|\*([^*]+)\*|([A-Z][\w' -]*?)(?=[),.;]))")


def anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but hyphens and underscores dropped, spaces as hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return text.replace(" ", "-")


def headings(path: Path) -> list[str]:
    lines, fenced = [], False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and re.match(r"#{1,6} ", line):
            lines.append(line.lstrip("#").strip())
    return lines


def anchors(path: Path) -> set[str]:
    seen, out = {}, set()
    for h in headings(path):
        a = anchor(h)
        n = seen.get(a, 0)
        seen[a] = n + 1
        out.add(a if n == 0 else f"{a}-{n}")
    return out


def resolve(source: Path, target: str) -> Path:
    here = source.parent / target
    return here if here.exists() or not target.startswith("docs/") else ROOT / target


def test_the_anchor_rule():
    assert anchor("Per-question cost: System One vs the answering model's open-all prefill") == \
        "per-question-cost-system-one-vs-the-answering-models-open-all-prefill"
    assert anchor("Rerank: `POST /rerank`, `/v1/rerank`, `/v2/rerank`") == "rerank-post-rerank-v1rerank-v2rerank"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_relative_links_and_anchors_resolve(doc):
    broken = []
    text = doc.read_text()
    targets = [m.group(1) for m in LINK.finditer(text)]
    targets += [f"{m.group(1)}#{m.group(2)}" for m in BARE.finditer(text)]
    for target in targets:
        if re.match(r"[a-z]+:", target):                    # http(s), mailto
            continue
        file, _, frag = target.partition("#")
        path = resolve(doc, file) if file else doc
        if not path.exists():
            broken.append(f"{target}: no file {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}")
        elif frag and path.suffix == ".md" and frag not in anchors(path):
            broken.append(f"{target}: no heading with anchor #{frag} in {path.name}")
    assert not broken, f"{doc.name}:\n" + "\n".join(broken)


def cited_sections():
    """(file, cited doc, section) for every `docs/x.md, "Section"` in the package, the tests, examples and the docs."""
    sources = [ROOT / "README.md"] + [p for base in ("pixeltriage", "tests", "docs", "examples")
                                      for p in sorted((ROOT / base).rglob("*"))
                                      if p.suffix in (".py", ".md", ".c", ".h") and p != Path(__file__).resolve()]
    for path in sources:
        for m in CITED.finditer(path.read_text()):
            section = next(g for g in m.groups()[1:] if g)
            yield path, m.group(1), " ".join(section.split())


def test_files_the_docs_name_exist():
    """A path under tests/, pixeltriage/ or examples/ that README or a doc names is a file or folder of the tree."""
    missing = []
    for doc in DOCS:
        for m in re.finditer(r"(?<![\w/.])((?:tests|pixeltriage|examples)/[\w./-]*\w)", doc.read_text()):
            if not (ROOT / m.group(1)).exists():
                missing.append(f"{doc.name}: {m.group(1)}")
    assert not missing, "paths that do not exist:\n" + "\n".join(missing)


def test_sections_cited_by_name_exist():
    """`docs/serve.md, "Limits"` (or *Limits*) must name the start of a heading of that file."""
    missing = []
    for source, doc, section in cited_sections():
        target = ROOT / doc
        if not target.exists():
            missing.append(f"{source.relative_to(ROOT)}: {doc} does not exist")
            continue
        names = [h.replace("`", "") for h in headings(target)]
        if not any(h.lower().startswith(section.lower()) for h in names):
            missing.append(f"{source.relative_to(ROOT)}: {doc} has no section {section!r}")
    assert not missing, "\n".join(missing)
