"""Every Python block of the README runs as pasted, in order, in a fresh directory, without a warning from fedprob.

The blocks share one namespace (each continues the ones before it, as the
README says). A block preceded by ``<!-- readme-test: skip REASON -->`` is not
run (it needs several processes, or names a file of yours); one preceded by
``<!-- readme-test: needs MODULE ... -->`` is skipped, with the reason, where a
module is missing. The default run executes the quickstart (the first block);
the whole README is ``-m slow``.
"""
from __future__ import annotations

import importlib.util
import os
import re
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE_DIRS = tuple(str(ROOT / d) for d in ("fedprob", "models", "inference"))
MARK = re.compile(r"<!--\s*readme-test:\s*(skip|needs)\s*(.*?)\s*-->")


def blocks(text: str) -> list:
    """(line, code, skip reason or None) of every ```python block, in order."""
    out, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        if lines[i].strip() == "```python":
            start = i
            j = i + 1
            while lines[j].strip() != "```":
                j += 1
            code = "\n".join(lines[i + 1:j])
            reason = None
            k = start - 1
            while k >= 0 and not lines[k].strip():
                k -= 1
            m = MARK.search(lines[k]) if k >= 0 else None
            if m and m.group(1) == "skip":
                reason = m.group(2) or "marked skip"
            elif m:
                gone = [mod for mod in m.group(2).split() if importlib.util.find_spec(mod) is None]
                reason = f"needs {', '.join(gone)}" if gone else None
            out.append((start + 1, code, reason))
            i = j
        i += 1
    return out


def from_fedprob(w: warnings.WarningMessage) -> bool:
    """A warning raised by fedprob: issued in its files, or pointing at a README block from inside it."""
    name = str(w.filename)
    return name.startswith(PACKAGE_DIRS) or name.startswith("<README")


def run_blocks(tmp_path, monkeypatch, count=None):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MPLBACKEND", "Agg")
    ns, ran, skipped = {"__name__": "__readme__"}, [], []
    todo = blocks((ROOT / "README.md").read_text())
    assert len(todo) >= 8, "the README's Python blocks were not found"
    for line, code, reason in todo[:count]:
        if reason is not None:
            skipped.append((line, reason))
            continue
        with warnings.catch_warnings(record=True) as rec:
            warnings.simplefilter("always")
            try:
                exec(compile(code, f"<README line {line}>", "exec"), ns)
            except Exception as e:                                  # noqa: BLE001 - report the block
                raise AssertionError(f"README block at line {line} failed: {type(e).__name__}: {e}") from e
        ours = [f"{w.category.__name__}: {w.message}" for w in rec if from_fedprob(w)]
        assert not ours, f"README block at line {line} warned:\n" + "\n".join(ours)
        ran.append(line)
    return ran, skipped


def test_readme_blocks_are_found_and_marked():
    todo = blocks((ROOT / "README.md").read_text())
    assert todo[0][2] is None and "import fedprob as fp" in todo[0][1]
    for line, code, reason in todo[1:]:
        if reason is None:
            assert code.lstrip().startswith("#") or "fp." in code or "import" in code, line


def test_readme_quickstart_runs_quietly(tmp_path, monkeypatch):
    ran, _ = run_blocks(tmp_path, monkeypatch, count=1)
    assert len(ran) == 1


@pytest.mark.slow
def test_every_readme_block_runs_in_order_without_a_warning(tmp_path, monkeypatch):
    ran, skipped = run_blocks(tmp_path, monkeypatch)
    print(f"ran the blocks at lines {ran}; skipped {skipped}")
    assert len(ran) >= 8
