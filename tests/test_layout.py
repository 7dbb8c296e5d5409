"""Import rules of the architecture: pallas_kernels stands alone, only jaxllm.ops uses it."""

import ast
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
    from pallas_kernels.cross_entropy import MASK_VALUE as KERNEL_MASK_VALUE

    assert KERNEL_MASK_VALUE == MASK_VALUE
