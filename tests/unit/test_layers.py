"""The transports' place in the layering, which import-linter cannot see (they are installed from transports/
as aiollm.transports): they import only the foundations and each other."""

import ast
from pathlib import Path

TRANSPORTS = Path(__file__).parents[2] / "transports"
ALLOWED = ("aiollm.errors", "aiollm.log", "aiollm.transports")


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return {n for n in names if n.split(".")[0] in ("aiollm", "bench", "tests")}


def test_transports_import_only_the_foundations_and_each_other():
    files = sorted(TRANSPORTS.glob("*.py"))
    assert files
    for path in files:
        above = {n for n in _imports(path) if not n.startswith(ALLOWED)}
        assert not above, f"{path.name} imports {sorted(above)}"
