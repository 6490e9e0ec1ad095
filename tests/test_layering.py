"""The package's imports, read from the source (AST, no import): they follow the layer order of
``docs/layering.md``, form no cycle (function-local imports included), and no module imports or reaches
into another module's private names. A planted violation of each kind is caught (the negative controls)."""
from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# where each package's sources live (setup.cfg's package_dir)
ROOTS = {"lbannpy": "src", "lbannpy.layers": "layers", "lbannpy.comm": "comm"}
EXTENSIONS = (".c", ".so", ".pyd")  # compiled modules: leaves, named by their source or build


@dataclass(frozen=True)
class Import:
    importer: str
    target: str          # the module imported (a submodule where ``from pkg import name`` names one)
    names: tuple         # what a ``from`` import takes from ``target`` (empty for a submodule or ``import``)
    line: int
    local: bool          # inside a function
    end: int = 0         # the statement's last line


@dataclass
class Tree:
    """The modules of a source tree laid out as ``ROOTS`` says, and their lbannpy imports."""

    files: dict = field(default_factory=dict)     # module -> path
    packages: set = field(default_factory=set)    # modules that are packages
    imports: list = field(default_factory=list)   # Import
    reaches: list = field(default_factory=list)   # (module, line, expression): ``x._name`` on another object
    # (module, line, expression, name): ``getattr(x, "_name")`` (or setattr, hasattr, delattr) with a literal
    by_name: list = field(default_factory=list)
    owned: set = field(default_factory=set)       # private attribute names lbannpy objects set on themselves


def _module_files(root: Path) -> dict:
    out = {}
    for pkg, top in ROOTS.items():
        base = root / top
        for path in sorted(base.rglob("*")):
            if "__pycache__" in path.parts or not path.is_file():
                continue
            rel = path.relative_to(base)
            if top == "src" and rel.parts[0] in ("layers", "comm"):
                continue
            stem = path.name.split(".")[0]
            if path.suffix == ".py":
                parts = list(rel.parts[:-1]) + ([] if stem == "__init__" else [stem])
            elif path.name.endswith(EXTENSIONS):
                parts = list(rel.parts[:-1]) + [stem]
            else:
                continue
            out.setdefault(".".join([pkg] + parts), path)
    return out


def _resolve(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def read_tree(root: Path) -> Tree:
    tree = Tree()
    tree.files = _module_files(root)
    tree.packages = {m for m, p in tree.files.items() if p.name == "__init__.py"}
    for module, path in tree.files.items():
        if path.suffix != ".py":
            continue
        src = ast.parse(path.read_text(encoding="utf-8"))
        outside = {a.asname or a.name.split(".")[0] for n in ast.walk(src) if isinstance(n, ast.Import)
                   for a in n.names if not a.name.startswith("lbannpy")}  # os, sys: their own public API
        _walk(tree, module, module in tree.packages, src, outside, depth=0)
    return tree


def _walk(tree: Tree, module: str, is_package: bool, node, outside: set, depth: int) -> None:
    for child in ast.iter_child_nodes(node):
        inner = depth + isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        if isinstance(child, ast.Import):
            for a in child.names:
                if a.name.startswith("lbannpy"):
                    tree.imports.append(Import(module, a.name, (), child.lineno, depth > 0, child.end_lineno))
        elif isinstance(child, ast.ImportFrom):
            target = _resolve(module, is_package, child)
            if target.startswith("lbannpy"):
                taken = []
                for a in child.names:
                    sub = f"{target}.{a.name}"
                    if sub in tree.files:
                        tree.imports.append(Import(module, sub, (), child.lineno, depth > 0,
                                                   child.end_lineno))
                    else:
                        taken.append(a.name)
                if taken:
                    tree.imports.append(Import(module, target, tuple(taken), child.lineno, depth > 0,
                                               child.end_lineno))
        elif (isinstance(child, ast.Call) and isinstance(child.func, ast.Name)
              and child.func.id in ("getattr", "setattr", "hasattr", "delattr") and len(child.args) >= 2
              and isinstance(child.args[1], ast.Constant) and isinstance(child.args[1].value, str)
              and _private(child.args[1].value)):
            obj = child.args[0]
            root = obj
            while isinstance(root, ast.Attribute):
                root = root.value
            if not (isinstance(obj, ast.Name) and obj.id in ("self", "cls")) and not (
                    isinstance(root, ast.Name) and root.id in outside):
                tree.by_name.append((module, child.lineno, ast.unparse(child), child.args[1].value))
        elif (isinstance(child, ast.Attribute) and _private(child.attr) and isinstance(child.ctx, ast.Store)
              and isinstance(child.value, ast.Name) and child.value.id == "self"):
            tree.owned.add(child.attr)
        if isinstance(child, ast.Attribute) and _private(child.attr):
            root = child.value
            while isinstance(root, ast.Attribute):
                root = root.value
            if not (isinstance(child.value, ast.Name) and child.value.id in ("self", "cls")) and not (
                    isinstance(root, ast.Name) and root.id in outside):
                tree.reaches.append((module, child.lineno, ast.unparse(child)))
        _walk(tree, module, is_package, child, outside, inner)


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _package_of(tree: Tree, module: str) -> str:
    return module if module in tree.packages else module.rpartition(".")[0]


def read_layers(text: str) -> dict:
    """``{name prefix: layer index}`` from the ```layers block of docs/layering.md (first line lowest)."""
    block = re.search(r"```layers\n(.*?)```", text, re.S)
    assert block, "docs/layering.md has no ```layers block"
    order = {}
    for i, line in enumerate(ln for ln in block.group(1).splitlines() if ln.strip()):
        _, *prefixes = line.split()
        for p in prefixes:
            assert p not in order, f"{p} is in two layers"
            order[p] = i
    return order


def layer_of(order: dict, module: str) -> int | None:
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        name = ".".join(parts[:n])
        if name in order:
            return order[name]
    return None


# -------------------------------------------------------------------------------------------------- checks
def unplaced(tree: Tree, order: dict) -> list[str]:
    return sorted(m for m in tree.files if layer_of(order, m) is None)


def against_order(tree: Tree, order: dict) -> list[str]:
    bad = []
    for imp in tree.imports:
        a, b = layer_of(order, imp.importer), layer_of(order, imp.target)
        if a is not None and b is not None and b > a:
            bad.append(f"{imp.importer}:{imp.line} imports {imp.target} (a higher layer)")
    return bad


def cycles(tree: Tree) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), over every import."""
    edges: dict = {}
    for imp in tree.imports:
        if imp.target in tree.files and imp.target != imp.importer:
            edges.setdefault(imp.importer, set()).add(imp.target)
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(tree.files):
        if v not in index:
            visit(v)
    return out


def with_package_inits(tree: Tree) -> Tree:
    """The tree with the imports Python adds: importing ``a.b.c`` first runs the ``__init__`` of ``a.b``
    (packages of the importer's own line excepted: they are already running)."""
    implied = []
    for imp in tree.imports:
        parts, own = imp.target.split("."), imp.importer.split(".")
        mine = {".".join(own[:n]) for n in range(1, len(own) + 1)}
        for n in range(2, len(parts)):
            pkg = ".".join(parts[:n])
            if pkg in tree.packages and pkg not in mine:
                implied.append(Import(imp.importer, pkg, (), imp.line, imp.local, imp.end))
    return Tree(tree.files, tree.packages, tree.imports + implied, tree.reaches, tree.by_name, tree.owned)


def private_crossings(tree: Tree) -> list[str]:
    """``from other import _name`` (a private submodule of the importer's own package is its own), and
    ``obj._name`` on anything but ``self``/``cls`` or an outside module."""
    bad = []
    for imp in tree.imports:
        for name in imp.names:
            if _private(name):
                bad.append(f"{imp.importer}:{imp.line} imports {imp.target}.{name}")
        leaf = imp.target.rpartition(".")[2]
        if not imp.names and _private(leaf) and imp.target.rpartition(".")[0] != _package_of(tree,
                                                                                               imp.importer):
            bad.append(f"{imp.importer}:{imp.line} imports private module {imp.target}")
    bad += [f"{m}:{line} reaches into {expr}" for m, line, expr in tree.reaches]
    # by name: a literal naming a private attribute that lbannpy objects set on themselves (a third-party
    # object's private names, e.g. torch's, are the attribute rule's outside modules' business)
    bad += [f"{m}:{line} reaches into {expr}" for m, line, expr, name in tree.by_name if name in tree.owned]
    return bad


def unexplained_local_imports(tree: Tree) -> list[str]:
    """Function-local lbannpy imports without a reason: a comment on the import's line, or on the line
    before the first of a run of consecutive imports (one reason covers the run)."""
    bad, lines = [], {}
    starts = {}  # (module, any line of an import statement) -> the statement's first line
    for imp in tree.imports:
        for n in range(imp.line, max(imp.end, imp.line) + 1):
            starts[(imp.importer, n)] = imp.line
    for imp in tree.imports:
        if not imp.local:
            continue
        text = lines.get(imp.importer)
        if text is None:
            text = lines[imp.importer] = tree.files[imp.importer].read_text(encoding="utf-8").splitlines()
        first = imp.line
        while (imp.importer, first - 1) in starts:  # the run of imports this one ends
            first = starts[(imp.importer, first - 1)]
        before = text[first - 2].strip() if first > 1 else ""
        if "#" not in text[imp.line - 1] and "#" not in text[first - 1] and not before.startswith("#"):
            bad.append(f"{imp.importer}:{imp.line} imports {imp.target} inside a function without a reason")
    return sorted(set(bad))


# --------------------------------------------------------------------------------------------------- tests
@pytest.fixture(scope="module")
def repo():
    return read_tree(REPO)


@pytest.fixture(scope="module")
def order():
    return read_layers((REPO / "docs" / "layering.md").read_text(encoding="utf-8"))


def test_every_module_has_a_layer(repo, order):
    assert len(repo.files) > 100  # the reader found the package
    assert unplaced(repo, order) == []


def test_imports_follow_the_layer_order(repo, order):
    bad = against_order(repo, order)
    assert bad == [], "\n".join(bad)


def test_no_module_cycle(repo):
    assert any(i.local for i in repo.imports)  # function-local imports are read too
    found = cycles(repo)
    assert found == [], found


def test_no_cycle_through_package_inits(repo, order):
    implied = with_package_inits(repo)
    bad = against_order(implied, order)
    found = cycles(implied)
    assert (bad, found) == ([], []), "\n".join(bad + [" <-> ".join(c) for c in found])


def test_no_module_uses_another_modules_private_names(repo):
    bad = private_crossings(repo)
    assert bad == [], "\n".join(bad)


def test_function_local_imports_carry_a_reason(repo):
    bad = unexplained_local_imports(repo)
    assert bad == [], f"{len(bad)}:\n" + "\n".join(bad)


def _plant(root: Path, files: dict) -> Tree:
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text, encoding="utf-8")
    return read_tree(root)


def test_the_checks_catch_planted_violations(tmp_path):
    """Negative controls: each check reports a planted violation of its rule, and passes the clean twin."""
    order = read_layers("```layers\nlow lbannpy.low lbannpy.layers lbannpy.comm\n"
                        "high lbannpy.high lbannpy\n```")
    clean = {"src/__init__.py": "", "layers/__init__.py": "", "comm/__init__.py": "",
             "src/low.py": "import os\nos._exit\n",
             "src/high.py": "from lbannpy import low\nfrom . import low as again\n",
             "layers/kernels/__init__.py": "", "layers/kernels/_fast.c": "",
             "layers/kernels/conv.py": ("def f():\n    # compiled, optional\n    from . import _fast\n"
                                        "    from .. import kernels\n    return _fast, kernels\n")}
    tree = _plant(tmp_path / "clean", clean)
    assert "lbannpy.layers.kernels._fast" in tree.files
    assert (unplaced(tree, order), against_order(tree, order), cycles(tree), private_crossings(tree),
            unexplained_local_imports(tree)) == ([], [], [], [], [])

    bad = dict(clean)
    bad["src/low.py"] = ("def late():\n    from lbannpy.high import _helper\n    return _helper\n\n\n"
                         "def reach(obj):\n    return obj._state\n\n\n"
                         "def by_name(obj):\n    return getattr(obj, '_acts', None), getattr(obj, '_t')\n\n\n"
                         "class Holder:\n    def __init__(self):\n        self._acts = {}\n")
    bad["src/high.py"] = "from lbannpy import low\n\n\ndef _helper():\n    pass\n"
    bad["comm/other.py"] = "from lbannpy.layers.kernels import _fast\n"
    tree = _plant(tmp_path / "bad", bad)
    assert against_order(tree, order) == ["lbannpy.low:2 imports lbannpy.high (a higher layer)"]
    assert cycles(tree) == [["lbannpy.high", "lbannpy.low"]]
    assert private_crossings(tree) == [
        "lbannpy.low:2 imports lbannpy.high._helper",
        "lbannpy.comm.other:1 imports private module lbannpy.layers.kernels._fast",
        "lbannpy.low:7 reaches into obj._state",
        "lbannpy.low:11 reaches into getattr(obj, '_acts', None)"]
    assert unexplained_local_imports(tree) == [
        "lbannpy.low:2 imports lbannpy.high inside a function without a reason"]
    assert unplaced(_plant(tmp_path / "bad", {"src/extra/__init__.py": ""}), order) == []  # lbannpy prefix

    # a package whose __init__ imports upward: importing a module inside it runs that __init__
    tree = _plant(tmp_path / "inits", {**clean, "src/low.py": "from lbannpy.pkg import leaf\n",
                                       "src/pkg/__init__.py": "from lbannpy import high\n",
                                       "src/pkg/leaf.py": "", "src/high.py": ""})
    order = read_layers("```layers\nlow lbannpy.low lbannpy.pkg.leaf lbannpy.layers lbannpy.comm\n"
                        "high lbannpy.high lbannpy.pkg lbannpy\n```")
    assert against_order(tree, order) == [] and cycles(tree) == []
    assert against_order(with_package_inits(tree), order) == [
        "lbannpy.low:1 imports lbannpy.pkg (a higher layer)"]
