"""TOML text of a configuration of flat tables (the ``config.toml`` of a run directory)."""
from __future__ import annotations


def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    raise ValueError(f"cannot write {type(v).__name__} to TOML")


def dumps(cfg: dict) -> str:
    """TOML text of a configuration of flat tables (strings, numbers, booleans, lists)."""
    lines = []
    for t, v in cfg.items():
        lines.append(f"[{t}]")
        lines += [f"{k} = {_toml_value(x)}" for k, x in v.items()]
        lines.append("")
    return "\n".join(lines)


__all__ = ["dumps"]
