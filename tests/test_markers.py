"""The inner loop (``python -m pytest -m "not distributed and not slow" tests``) must not spawn:
every test module that spawns ranks or launches processes carries the ``distributed`` marker."""
import ast
import pathlib

import pytest

TESTS = pathlib.Path(__file__).parent


def _module_marks(tree) -> set:
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "pytestmark" for t in node.targets):
            values = node.value.elts if isinstance(node.value, (ast.List, ast.Tuple)) else [node.value]
            return {v.attr for v in values if isinstance(v, ast.Attribute)}
    return set()


def _launches(tree) -> bool:
    """A call of distributed.spawn, subprocess.* or a multiprocessing process."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
            owner = f.value.id if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) else ""
            if name == "spawn" or owner in ("subprocess", "mp", "multiprocessing") or name in ("Popen", "Process"):
                return True
    return False


@pytest.mark.parametrize("path", sorted(TESTS.glob("test_*.py")), ids=lambda p: p.name)
def test_launching_modules_are_marked_distributed(path):
    tree = ast.parse(path.read_text())
    if _launches(tree):
        assert "distributed" in _module_marks(tree), f"{path.name} launches processes: add pytestmark distributed"
