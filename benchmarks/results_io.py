"""Where a benchmark script's results go: ``<dest>/<name>.json`` and ``<dest>/<name>.md``."""
from __future__ import annotations

import json
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def destination(out_arg, quick: bool):
    """``--out`` when given, else benchmarks/results for a full run and nothing (None) for ``--quick``."""
    if out_arg is not None:
        return out_arg
    return None if quick else str(RESULTS)


def write_results(dest, name: str, out: dict, md_lines) -> None:
    """Write ``out`` as JSON and the Markdown lines, unless ``dest`` is None."""
    if not dest:
        return
    Path(dest).mkdir(parents=True, exist_ok=True)
    (Path(dest) / f"{name}.json").write_text(json.dumps(out, indent=2))
    (Path(dest) / f"{name}.md").write_text("\n".join(md_lines) + "\n")
