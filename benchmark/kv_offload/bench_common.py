"""What the kv offload benchmarks share: the page size, the results files' JSON layout and the
commit they record."""

from __future__ import annotations

import gzip
import json
import subprocess
from pathlib import Path
from typing import Any

PAGE = 64
RESULTS_LINE = 160  # results_json's longest one-line list
ROOT = Path(__file__).resolve().parents[2]


def results_json(doc: Any, level: int = 0) -> str:
    """``doc`` as JSON indented by one space per level, with each list of scalars (tokens, a
    shape) and each list of lists that fits in ``RESULTS_LINE`` characters (a profiled kernel) on
    one line: half the bytes of ``json.dumps(doc, indent=1)``, which keeps the work tree small
    enough to carry to the GPU."""
    inner, outer = " " * (level + 1), " " * level
    if isinstance(doc, dict) and doc:
        items = (
            f"{inner}{json.dumps(str(k))}: {results_json(v, level + 1)}" for k, v in doc.items()
        )
        return "{\n" + ",\n".join(items) + f"\n{outer}}}"
    if not isinstance(doc, list) or not doc:
        return json.dumps(doc)
    if not any(isinstance(v, dict) for v in doc):  # serialized only where it may be the answer
        flat = json.dumps(doc)
        if len(flat) <= RESULTS_LINE or not any(isinstance(v, list) for v in doc):
            return flat
    return "[\n" + ",\n".join(inner + results_json(v, level + 1) for v in doc) + f"\n{outer}]"


def read_results(path: str) -> Any:
    """A results file, ``.json`` or gzip'd ``.json.gz`` (the largest committed ones, compressed to
    keep the work tree small enough to carry to the GPU: ``zcat`` reads them too)."""
    if str(path).endswith(".gz"):
        with gzip.open(path, "rt") as f:
            return json.load(f)
    return json.loads(Path(path).read_text())


def git_commit() -> str:
    """The checkout's short commit, ``-dirty`` appended where tracked files differ from it (a work
    tree copied over an older repository, as on the device machine); '' where there is no git or
    no repository."""
    try:
        run = subprocess.run(
            ["git", "describe", "--always", "--dirty", "--abbrev=7", "--exclude=*"],
            cwd=ROOT,
            capture_output=True,
        )
    except OSError:
        return ""
    return run.stdout.decode().strip()
