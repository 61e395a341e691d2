"""docs/design.md maps the whole package: every module in its module map, every NOTE block in its index."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "packfn"
DESIGN = (ROOT / "docs" / "design.md").read_text()

# A NOTE block starts with its title alone on a line (of a comment or a docstring); references name it inline.
NOTE = re.compile(r"^\s*(?:#\s*)?NOTE \[([^\]]+)\]\s*$")


def _section(title: str) -> str:
    start = DESIGN.index(f"## {title}")
    end = DESIGN.find("\n## ", start + 1)
    return DESIGN[start : None if end < 0 else end]


def _notes() -> dict[str, str]:
    """Each NOTE block's title and the module that holds it (``packfn/...``)."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        for line in path.read_text().splitlines():
            match = NOTE.match(line)
            if match:
                assert match.group(1) not in found, f"NOTE [{match.group(1)}] is written twice"
                found[match.group(1)] = path.relative_to(ROOT).as_posix()
    return found


def _map_entry(path: Path) -> str:
    """How the module map names a module: ``data/fit.py``, a subpackage by its folder (``data/``)."""
    relative = path.relative_to(PACKAGE)
    if relative.name == "__init__.py" and relative.parent != Path():
        return f"{relative.parent.as_posix()}/"
    return relative.as_posix()


def _mapped() -> set[str]:
    """The module map's entries: ``packfn/`` at the top, a subpackage's modules indented under its folder."""
    tree = _section("The layers in the tree")
    block = tree[tree.index("```\npackfn/") + 4 : tree.index("```", tree.index("```\npackfn/") + 3)]
    entries, folder = set(), ""
    for line in block.splitlines()[1:]:
        indent, name = len(line) - len(line.lstrip()), line.split()[0] if line.strip() else ""
        if indent == 2:
            folder = name if name.endswith("/") else ""
            entries.add(name)
        elif indent == 4 and folder and name.endswith(".py"):
            entries.add(folder + name)
    return entries


def test_the_module_map_lists_every_module():
    mapped = _mapped()
    missing = [_map_entry(path) for path in sorted(PACKAGE.rglob("*.py")) if _map_entry(path) not in mapped]
    assert not missing, f"docs/design.md's module map omits {missing}"


def test_the_note_index_lists_every_note_where_it_is():
    index = _section("NOTE blocks")
    rows = dict(re.findall(r"^\| (.+?) \| `(packfn/[^`]+)` \|", index, flags=re.MULTILINE))
    assert rows == _notes()
