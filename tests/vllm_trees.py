"""Writable copies of the wheel's vllm/ package that cost little disk.

A full copy is about 750 MB, almost all of it compiled extensions (.so) that no patch and no
test writes. CI's disk is shared and sometimes nearly full, and the suite makes dozens of copies:
each copy hard-links every file but the Python sources, which the series and the tests edit.
"""

import os
import shutil
from pathlib import Path

WRITABLE_SUFFIXES = frozenset({".py", ".pyi"})


def _copy_or_link(source: str, target: str) -> None:
    if Path(source).suffix in WRITABLE_SUFFIXES:
        shutil.copy2(source, target)
        return
    try:
        os.link(source, target)
    except OSError:  # another filesystem, or links not allowed: a real copy still works
        shutil.copy2(source, target)


def copy_vllm_tree(source: Path, target: Path) -> Path:
    """Copy the vllm/ folder `source` to `target` (which must not exist) and return `target`.
    Write only its Python sources: the other files are shared with `source`."""
    return Path(shutil.copytree(source, target, copy_function=_copy_or_link))
