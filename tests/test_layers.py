"""The packages depend one way (docs/architecture.md): a module imports only its own layer and the layers below,
at module level or inside a function alike. A change that makes weights import the engine back fails here."""
import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "pixeltriage"

# lowest first; a module may import any module of its own layer or of a layer before it
LAYERS = [
    {"pixeltriage.errors", "pixeltriage.settings", "pixeltriage.paths", "pixeltriage.config", "pixeltriage.lazy",
     "pixeltriage.hub", "pixeltriage.libc", "pixeltriage.media"},
    {"pixeltriage.kernels"},
    {"pixeltriage.weights"},
    {"pixeltriage.store"},
    {"pixeltriage.engine", "pixeltriage.retrieval"},
    {"pixeltriage.episode", "pixeltriage.delivery"},
    {"pixeltriage.serve"},
    {"pixeltriage.integrations", "pixeltriage.bench.models"},
    {"pixeltriage.bench"},
    {"pixeltriage.cli", "pixeltriage.__main__"},
]


def layer_of(module: str) -> int:
    for depth, roots in enumerate(LAYERS):
        if any(module == r or module.startswith(r + ".") for r in roots):
            return depth
    raise AssertionError(f"{module} belongs to no layer: add it to LAYERS (and to docs/architecture.md)")


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path):
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.module


def test_every_import_points_down_or_sideways():
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        source = module_name(path)
        if source == "pixeltriage":          # the package's lazy name table, above everything by design
            continue
        for target in imports(path):
            if target.split(".")[0] == "pixeltriage" and target != "pixeltriage" \
                    and layer_of(target) > layer_of(source):
                wrong.append(f"{source} imports {target}")
    assert not wrong, "imports against the layering:\n" + "\n".join(wrong)


def test_retrieval_and_the_engine_import_nothing_of_each_other():
    """Beside each other in one layer (retrieval -> engine -> delivery is the data's way, not an import)."""
    crossing = []
    for path in sorted(PACKAGE.rglob("*.py")):
        source = module_name(path)
        for mine, other in (("pixeltriage.engine", "pixeltriage.retrieval"),
                            ("pixeltriage.retrieval", "pixeltriage.engine")):
            if source == mine or source.startswith(mine + "."):
                crossing += [f"{source} imports {t}" for t in imports(path) if t == other or t.startswith(other + ".")]
    assert not crossing, "\n".join(crossing)


def test_the_layers_cover_the_package():
    for path in PACKAGE.rglob("*.py"):
        name = module_name(path)
        if name != "pixeltriage":
            layer_of(name)
