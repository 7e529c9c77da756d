"""The suite's own layout: a helper that tests share lives in a helper module
(`tests/integration/rawservers.py`, `scraping.py`, `tests/unit/fakes.py`, ...), never in
another test module, so that running or changing one test file runs or changes only that."""

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def _imported_modules(path: Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.append(node.module)
        elif isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
    return names


def test_no_test_module_imports_another():
    found = [f"{path.relative_to(TESTS.parent)} imports {name}"
             for path in sorted(TESTS.rglob("*.py"))
             for name in _imported_modules(path)
             if name.startswith("tests.") and name.rsplit(".", 1)[-1].startswith("test_")]
    assert not found, "move what they share into a helper module:\n" + "\n".join(found)


def test_the_check_sees_such_an_import(tmp_path):
    module = tmp_path / "test_x.py"
    module.write_text("from tests.integration.test_ordering import Client\nimport os\n")
    assert _imported_modules(module) == ["tests.integration.test_ordering", "os"]
