"""Import rules of the architecture: pallas_kernels stands alone, only jaxllm.ops uses it, and
no import circles (imports inside functions count)."""

import ast
import fnmatch
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# The kernel benchmark's subject is the kernels themselves; every model path goes through ops.
ALLOWED = {"jaxllm/ops.py", "jaxllm/profiling/kernel_bench.py"}


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def module_name(path: Path, root: Path = ROOT) -> str:
    """pallas_kernels/common.py -> pallas_kernels.common; a package's __init__.py -> the package."""
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_module(name: str, root: Path = ROOT) -> bool:
    """`name` (dotted) is a module or package of the project under `root`."""
    path = root.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def module_imports(path: Path, root: Path = ROOT) -> set[str]:
    """The project modules the file at `path` imports, at module level or inside functions.
    `from X import a` counts as X.a where that is a module, else as X."""
    name = module_name(path, root)
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: `from .` is the package, each extra dot one level up
                base = ".".join([*package[: len(package) + 1 - node.level], *[base] * bool(base)])
            for a in node.names:
                found.add(f"{base}.{a.name}" if is_module(f"{base}.{a.name}", root) else base)
    return {m for m in found if is_module(m, root)} - {name}


def imports_inside_functions(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every import inside a function of the file at `path`."""
    found = set()
    for fn in ast.walk(ast.parse(path.read_text())):
        if isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
            for node in ast.walk(fn):
                if isinstance(node, ast.Import):
                    found |= {(node.lineno, a.name) for a in node.names}
                elif isinstance(node, ast.ImportFrom):
                    found.add((node.lineno, "." * node.level + (node.module or "")))
    return sorted(found)


def import_graph(package: str, root: Path = ROOT) -> dict[str, set[str]]:
    """module -> the project modules it imports, for every module of `package`."""
    return {module_name(p, root): module_imports(p, root) for p in (root / package).rglob("*.py")}


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import circles of `graph`: each set of modules that all reach one another (a strongly
    connected component of more than one module), sorted."""

    def reachable(start: str) -> set[str]:
        seen, todo = set(), [start]
        while todo:
            for m in graph.get(todo.pop(), ()):
                if m not in seen:
                    seen.add(m)
                    todo.append(m)
        return seen

    reach = {m: reachable(m) for m in graph}
    in_circle = [m for m in graph if m in reach[m]]
    circles = {frozenset(n for n in reach[m] if m in reach.get(n, ())) for m in in_circle}
    return sorted(sorted(c) for c in circles)


def test_find_cycles_counts_imports_inside_functions(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("from .a import f\n")
    (pkg / "a.py").write_text("from . import c\n\ndef f():\n    from .b import g\n")
    (pkg / "b.py").write_text("import pkg.a\n\ndef g():\n    pass\n")
    (pkg / "c.py").write_text("import json\n")
    graph = import_graph("pkg", tmp_path)
    assert graph["pkg.a"] == {"pkg.b", "pkg.c"} and graph["pkg"] == {"pkg.a"}
    assert imports_inside_functions(pkg / "a.py") == [(4, ".b")]
    assert find_cycles(graph) == [["pkg.a", "pkg.b"]]


def test_pallas_kernels_have_no_import_cycles():
    graph = import_graph("pallas_kernels")
    assert graph["pallas_kernels.cross_entropy"] >= {
        "pallas_kernels.cross_entropy_triton",
        "pallas_kernels.cross_entropy_mgpu",
    }
    assert find_cycles(graph) == []


def test_pallas_kernels_import_only_at_module_level():
    found = {p.name: imports_inside_functions(p) for p in (ROOT / "pallas_kernels").glob("*.py")}
    assert not any(found.values()), found


def test_pallas_kernel_variants_share_only_modules_below_them():
    """A kernel's Triton and Mosaic GPU modules import neither each other nor their op's public
    module (which dispatches to them)."""
    graph = import_graph("pallas_kernels")
    for module, imported in graph.items():
        op, _, variant = module.rpartition("_")
        if variant in ("triton", "mgpu") and op != "pallas_kernels.rows":
            other = f"{op}_{'mgpu' if variant == 'triton' else 'triton'}"
            assert not imported & {op, other}, (module, imported & {op, other})


# jaxllm's layers, lowest first: a module imports from its own layer and those below it only.
LAYERS = {
    "base": ["jaxllm", "jaxllm.config", "jaxllm.functional", "jaxllm.atomic_file",
             "jaxllm.console", "jaxllm.xla_flags"],
    "ops": ["jaxllm.ops"],
    "layers": ["jaxllm.layers"],
    "models": ["jaxllm.models*"],
    # pure functions of a model: sampling, beam search, BLEU of its translations
    "decoding": ["jaxllm.generate", "jaxllm.bleu"],
    "data": ["jaxllm.data*"],
    "training": ["jaxllm.train*", "jaxllm.pipeline", "jaxllm.parallel", "jaxllm.distributed"],
    "apps": ["jaxllm.runs", "jaxllm.translate", "jaxllm.tasks*",
             "jaxllm.profiling*", "jaxllm.plot"],
}  # fmt: skip
# Imports inside functions: optional or GPU-only dependencies, and private modules that may move.
LAZY = {
    "torch": "the PyTorch reference: optional",
    "matplotlib": "plots only: optional",
    "datasets": "Hugging Face data: optional extra",
    "triton": "GPU-only timing",
    "nvtx": "NVTX ranges: optional",
    "jax._src": "private jax API, guarded: may move",
    "orbax.checkpoint._src": "private orbax API, guarded: may move",
}


def _layer(module: str) -> int:
    found = [i for i, pats in enumerate(LAYERS.values())
             if any(fnmatch.fnmatchcase(module, p) for p in pats)]  # fmt: skip
    assert len(found) == 1, f"{module} is in {len(found)} layers: place it in LAYERS"
    return found[0]


def test_jaxllm_imports_run_down_the_layers_without_circles():
    graph = import_graph("jaxllm") | import_graph("pallas_kernels")
    assert find_cycles(graph) == []
    up = [
        f"{m} ({list(LAYERS)[_layer(m)]}) imports {i} ({list(LAYERS)[_layer(i)]})"
        for m, imported in graph.items() if m.startswith("jaxllm")
        for i in imported if i.startswith("jaxllm.") and _layer(i) > _layer(m)
    ]  # fmt: skip
    assert not up, up


def test_jaxllm_imports_inside_functions_are_optional_dependencies():
    found = [
        f"{p.relative_to(ROOT)}:{line} {name}"
        for p in (ROOT / "jaxllm").rglob("*.py")
        for line, name in imports_inside_functions(p)
        if not any(name == k or name.startswith(k + ".") for k in LAZY)
    ]
    assert not found, found


def test_pallas_kernels_never_import_jaxllm():
    for path in (ROOT / "pallas_kernels").glob("*.py"):
        assert "jaxllm" not in _imports(path), path


def test_only_ops_imports_pallas_kernels():
    users = {
        str(p.relative_to(ROOT))
        for p in (ROOT / "jaxllm").rglob("*.py")
        if "pallas_kernels" in _imports(p)
    }
    assert users <= ALLOWED, users - ALLOWED
    assert "jaxllm/ops.py" in users


def test_one_mask_value():
    from jaxllm.functional import MASK_VALUE
    from pallas_kernels.common import MASK_VALUE as KERNEL_MASK_VALUE

    assert KERNEL_MASK_VALUE == MASK_VALUE
