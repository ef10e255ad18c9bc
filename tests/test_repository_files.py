"""The files a new user reads before the code: the licence, what the README says `.ci/run` installs, and the layout."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_licence_file_is_the_one_pyproject_names() -> None:
    # (tomllib is 3.11+; the project supports 3.10)
    assert re.search(r'^license = \{ text = "Apache-2.0" \}$', (ROOT / "pyproject.toml").read_text(), re.M)
    text = (ROOT / "LICENSE").read_text()
    assert text.lstrip().startswith("Apache License") and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text


def test_the_readme_names_every_package_ci_installs() -> None:
    line = next(line for line in (ROOT / ".ci" / "run").read_text().splitlines() if "apt-get install" in line)
    packages = [word for word in re.sub(r">.*$", "", line).split()[3:] if not word.startswith("-")]
    assert "chromium" in packages and "iproute2" in packages
    readme = (ROOT / "README.md").read_text()
    missing = [package for package in packages if f"`{package}`" not in readme and package not in readme]
    assert missing == [], f"README's list of what .ci/run installs leaves out {missing}"


def test_the_tree_is_as_ruff_format_writes_it() -> None:
    """One layout, the formatter's ([tool.ruff] in pyproject.toml): `ruff format src tests bench` fixes a failure."""
    ruff = Path(sys.executable).with_name("ruff")
    found = subprocess.run(
        [str(ruff) if ruff.exists() else "ruff", "format", "--check", "src", "tests", "bench"], cwd=ROOT, capture_output=True, text=True
    )
    assert found.returncode == 0, found.stdout + found.stderr
