"""Install everything under one import name, ``dynspec_patch``, keeping the repository layout.

``patcher/``, ``transforms/`` and ``fixtures/`` stay where they are; setuptools maps them to
``dynspec_patch.patcher``, ``dynspec_patch.transforms`` and ``dynspec_patch.fixtures``
(``[tool.setuptools.package-dir]``), and every reference in the repository is rewritten to
the new names: ``from patcher... import``, dotted module names in strings (``"patcher.cli"``,
``-m patcher.cli``) and ``importlib.resources.files("fixtures")``; then ``ruff --fix`` sorts
and wraps the rewritten import blocks. Prose that names a module relative to the package
(``patcher.engine``) is left as it is.

Idempotent: run it again after merging work that still uses the old names
(``python tools/rename_imports.py``); it prints each file it changed and exits 1 if it finds
a bare ``import patcher`` it cannot rewrite safely.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TOP = "dynspec_patch"
OLD = "patcher|transforms|fixtures"

REWRITES = (
    # from patcher.engine import X  /  from transforms import Y
    (re.compile(rf"(?m)^(\s*)from ({OLD})(?=[.\s])"), rf"\1from {TOP}.\2"),
    # "patcher.cli", 'patcher.releases._pip_available' (dotted module names in strings)
    (re.compile(rf"""(["'])({OLD})((?:\.\w+)+)(?=\1)"""), rf"\1{TOP}.\2\3"),
    # importlib.resources.files("fixtures")
    (re.compile(rf"""resources\.files\((["'])({OLD})\1\)"""), rf"resources.files(\1{TOP}.\2\1)"),
    # python -m patcher.cli
    (re.compile(rf"-m ({OLD})\."), rf"-m {TOP}.\1."),
)
BARE_IMPORT = re.compile(rf"(?m)^\s*import ({OLD})\b")

SETUPTOOLS = f'''[tool.setuptools]
# One import name: the directories keep their place in the repository, installed under {TOP}.
packages = [
    "{TOP}.patcher",
    "{TOP}.transforms",
    "{TOP}.transforms.runtime",
    "{TOP}.fixtures",
]

[tool.setuptools.package-dir]
"{TOP}.patcher" = "patcher"
"{TOP}.transforms" = "transforms"
"{TOP}.fixtures" = "fixtures"

[tool.setuptools.package-data]
"{TOP}.fixtures" = ["*.toml"]
'''


def tracked_files() -> list[Path]:
    listed = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard"],
        cwd=REPO, capture_output=True, text=True, check=True,
    ).stdout.split()
    return [REPO / name for name in listed if name.endswith((".py", ".sh", ".md"))]


def rewrite_source(text: str) -> str:
    for pattern, replacement in REWRITES:
        text = pattern.sub(replacement, text)
    return text


def rewrite_pyproject(text: str) -> str:
    text = re.sub(r'(?m)^(dynspec-patch = ")(?:dynspec_patch\.)?patcher\.cli:main"',
                  rf'\g<1>{TOP}.patcher.cli:main"', text)
    # the [tool.setuptools] table and its sub-tables, up to the next unrelated table
    block = re.compile(
        r"(?ms)^\[tool\.setuptools(?:\.[\w-]+)?\]\n.*?(?=^\[(?!tool\.setuptools)|\Z)"
    )
    text = block.sub(_once(SETUPTOOLS), text)
    if "[tool.ruff.lint.isort]" not in text:  # no directory of that name: tell ruff it is ours
        text = text.rstrip("\n") + f'\n\n[tool.ruff.lint.isort]\nknown-first-party = ["{TOP}"]\n'
    return text


def _once(replacement: str):
    """A re.sub callback that puts ``replacement`` at the first match and drops the others."""
    done = []

    def substitute(match: re.Match[str]) -> str:
        if done:
            return ""
        done.append(True)
        return replacement + ("\n" if match.group(0).endswith("\n\n") else "")

    return substitute


def sort_imports(paths: list[Path]) -> None:
    """Re-sort and re-wrap the import blocks the rewrite lengthened (ruff's isort rule)."""
    ruff = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    if ruff is None:
        print("ruff not found: run 'ruff check --fix --select I .' yourself", file=sys.stderr)
        return
    subprocess.run([ruff, "check", "--quiet", "--fix", "--select", "I", *map(str, paths)],
                   cwd=REPO, check=False)


def main() -> int:
    changed, problems = [], []
    for path in tracked_files():
        if path.resolve() == Path(__file__).resolve():
            continue
        text = path.read_text()
        new = rewrite_source(text)
        if path.suffix == ".py":
            problems += [f"{path.relative_to(REPO)}: {m.group(0).strip()}"
                         for m in BARE_IMPORT.finditer(new)]
        if new != text:
            path.write_text(new)
            changed.append(path)
    pyproject = REPO / "pyproject.toml"
    text = pyproject.read_text()
    new = rewrite_pyproject(text)
    if new != text:
        pyproject.write_text(new)
        changed.append(pyproject)
    python = [p for p in changed if p.suffix == ".py"]
    if python:
        sort_imports(python)
    for path in changed:
        print(f"rewrote {path.relative_to(REPO)}")
    for problem in problems:
        print(f"cannot rewrite safely (use 'from ... import'): {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
