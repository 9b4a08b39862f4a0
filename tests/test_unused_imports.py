"""No unused imports in the modules listed here (read from the source with ``ast``, per function: an import inside a
function must be used in that function, a module-level one anywhere in the module). A ``noqa`` comment on the line
keeps a deliberate re-export."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHECKED = ["parity/harness/run.py"]
_SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)


def unused_imports(path: Path) -> list[str]:
    """``line: name`` for each name an import binds and nothing in its scope reads."""
    src = path.read_text(encoding="utf-8")
    lines, tree = src.splitlines(), ast.parse(src, filename=str(path))
    out = []
    for scope in [tree, *(n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)))]:
        own, stack = [], list(ast.iter_child_nodes(scope))
        while stack:   # the scope's own imports, not those of a function nested in it
            n = stack.pop()
            if isinstance(n, (ast.Import, ast.ImportFrom)):
                own.append(n)
            elif not isinstance(n, _SCOPES):
                stack.extend(ast.iter_child_nodes(n))
        used = {n.id for n in ast.walk(scope) if isinstance(n, ast.Name)}
        for imp in own:
            if isinstance(imp, ast.ImportFrom) and imp.module == "__future__" or "noqa" in lines[imp.lineno - 1]:
                continue
            for a in imp.names:
                bound = a.asname or a.name.split(".")[0]
                if bound not in used:
                    out.append(f"{imp.lineno}: {bound}")
    return sorted(out)


@pytest.mark.parametrize("rel", CHECKED)
def test_no_unused_imports(rel):
    assert unused_imports(ROOT / rel) == [], rel


def test_the_check_sees_an_import_unused_in_its_own_function(tmp_path):
    """Negative control: a name imported in one function and used only in another is unused where imported."""
    f = tmp_path / "probe.py"
    f.write_text("import os\n\ndef a():\n    from pathlib import Path\n    return 1\n\n"
                 "def b():\n    from pathlib import Path  # used here\n    return Path(os.sep)\n")
    assert unused_imports(f) == ["4: Path"]
