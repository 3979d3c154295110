"""No package imports one above it: every product module's imports, read with `ast` (lazy imports inside
functions included), go only to its own package or to packages of a lower layer in LAYERS.

The order is the code's own (derived from its imports, not wished for): `tandem` (wire messages,
statuses, roles) imports nothing of the project; `policies` (pure decisions) only `tandem`; `engine`
(model, KV pool, workers, transports) never control, frontdoor or ops; `model_repository` holds the
Triton model files over engine; `builder` writes engines and repositories; `control` (orchestrator,
routing, handoff) sits under the front doors that call it; `ops` starts it all; `planner` plans from
measurements and simulation; then the clients, the command line and the scripts on top.
"""

from __future__ import annotations

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

LAYERS: tuple[tuple[str, ...], ...] = (
    ("tandem",),
    ("policies",),
    ("engine",),
    ("model_repository",),
    ("builder",),
    ("control",),
    ("frontdoor",),
    ("ops", "planner"),
    ("clients",),
    ("cli",),
    ("scripts",),
)
RANK = {package: i for i, layer in enumerate(LAYERS) for package in layer}
NOT_PRODUCT = {"tests", "docs", "deploy"}


def product_files(root: str = ROOT) -> list[str]:
    """Every .py file under a top-level folder of the repository that is product code."""
    out = []
    for top in sorted(os.listdir(root)):
        folder = os.path.join(root, top)
        if top.startswith(".") or top in NOT_PRODUCT or not os.path.isdir(folder):
            continue
        for dirpath, dirs, files in os.walk(folder):
            dirs[:] = [d for d in dirs if d != "__pycache__" and not d.startswith(".")]
            out += [os.path.relpath(os.path.join(dirpath, f), root) for f in files if f.endswith(".py")]
    return sorted(out)


def imported_modules(path: str, root: str = ROOT) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in the file, at any depth; relative ones resolved."""
    with open(os.path.join(root, path), encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    package = os.path.dirname(path).replace(os.sep, ".")
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                out.append((node.lineno, ".".join(base + ([node.module] if node.module else []))))
            else:
                out.append((node.lineno, node.module))
    return out


def violations(root: str = ROOT) -> list[str]:
    """`file:line imports module` for each import of a package in a higher (or the same, other) layer."""
    out = []
    for path in product_files(root):
        own = path.split(os.sep)[0]
        for line, module in imported_modules(path, root):
            top = module.split(".")[0]
            if top == own or top not in RANK:
                continue  # its own package, or not the project's (stdlib, third party)
            if RANK[top] >= RANK[own]:
                out.append(f"{path}:{line} ({own}, layer {RANK[own]}) imports {module} ({top}, layer {RANK[top]})")
    return out


def test_every_product_package_has_a_layer():
    tops = {p.split(os.sep)[0] for p in product_files()}
    assert tops - set(RANK) == set(), "add the new package to LAYERS in tests/test_layering.py"
    assert set(RANK) <= tops, "a package in LAYERS is gone: remove it"


def test_no_package_imports_one_above_it():
    found = violations()
    assert found == [], "imports against the layer order:\n" + "\n".join(found)


def test_tandem_imports_nothing_of_the_project_but_itself():
    others = [f"{p}:{line} {m}" for p in product_files() if p.startswith("tandem" + os.sep)
              for line, m in imported_modules(p) if m.split(".")[0] in RANK and not m.startswith("tandem")]
    assert others == []


def test_a_violation_is_found(tmp_path):
    """The checker itself: an engine module that imports control (lazily, inside a function) is reported."""
    for package in ("engine", "control"):
        (tmp_path / package).mkdir()
    (tmp_path / "control" / "fleet.py").write_text("X = 1\n")
    (tmp_path / "engine" / "model.py").write_text("def f():\n    from control.fleet import X\n    return X\n")
    (tmp_path / "engine" / "ok.py").write_text("from . import model\nimport os\n")
    assert violations(str(tmp_path)) == ["engine/model.py:2 (engine, layer 2) imports control.fleet (control, layer 5)"]
