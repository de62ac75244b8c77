"""The package's structure: no import cycles (between modules, and between the packages of
`sparrow/`), and no knowledge of a model family outside `models/`: no module elsewhere
imports a model file, names a registered `model_type`, or branches on a `ModelArgs` class."""

import ast
from pathlib import Path

import sparrow
from sparrow.models import ARCHITECTURES, MODEL_TYPES

ROOT = Path(sparrow.__file__).parent
GENERATED = {"sparrow.proto.worker_pb2", "sparrow.proto.worker_pb2_grpc"}


def _modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        if name not in GENERATED:
            out[name] = path
    return out


MODULES = _modules()


def _type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST, module: str, is_package: bool) -> set[str]:
    """The sparrow modules `module` imports anywhere (functions included), but not under
    `if TYPE_CHECKING:`."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = module if is_package else module.rpartition(".")[0]
                for _ in range(node.level - 1):
                    package = package.rpartition(".")[0]
                base = f"{package}.{base}" if base else package
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.add(sub if sub in MODULES else base)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return {m for m in found if m in MODULES and m != module}


def _graph() -> dict[str, set[str]]:
    return {
        name: _imports(ast.parse(path.read_text()), name, path.name == "__init__.py")
        for name, path in MODULES.items()
    }


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component of more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return out


def _package(module: str) -> str:
    parts = module.split(".")
    return ".".join(parts[:2])


def test_no_module_import_cycles():
    assert _cycles(_graph()) == []


def test_no_package_import_cycles():
    packages: dict[str, set[str]] = {}
    for module, imported in _graph().items():
        edges = packages.setdefault(_package(module), set())
        edges.update(_package(m) for m in imported if _package(m) != _package(module))
    assert _cycles(packages) == []


def _outside_models() -> dict[str, Path]:
    return {n: p for n, p in MODULES.items() if not n.startswith("sparrow.models")}


def test_no_model_file_imported_outside_models():
    model_files = {f"sparrow.models.{name}" for name in ARCHITECTURES}
    model_files |= {m for m in MODULES if m.startswith("sparrow.models.vision.")}
    offenders = {
        name: sorted(imported & model_files)
        for name, imported in _graph().items()
        if not name.startswith("sparrow.models") and imported & model_files
    }
    assert offenders == {}


def test_no_model_type_or_model_args_class_named_outside_models():
    offenders = []
    for name, path in _outside_models().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and node.value in MODEL_TYPES:
                offenders.append(f"{name}:{node.lineno}: {node.value!r}")
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in ("isinstance", "issubclass")
                and "ModelArgs" in ast.unparse(node.args[1])
            ):
                offenders.append(f"{name}:{node.lineno}: {ast.unparse(node)}")
    assert offenders == []
