"""A module of this repository as it was at another git revision, for the benchmarks that check a
faster function against the one it replaced (align_targets.py, vision_batch_prep.py)."""
from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def module_at(rev: str, path: str, tmp: Path):
    """The file `path` (relative to the repository root) at git revision `rev`, written into `tmp` and
    imported as "<its stem>_reference"."""
    source = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:{path}"],
                            check=True, capture_output=True, text=True).stdout
    name = f"{Path(path).stem}_reference"
    file = tmp / f"{name}.py"
    file.write_text(source)
    spec = importlib.util.spec_from_file_location(name, file)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module
