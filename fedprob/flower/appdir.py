"""``fedprob flower app``: a Flower App directory for a fedprob configuration.

The directory holds one ``pyproject.toml``: its ``[tool.flwr.app.components]``
point at fedprob's ServerApp (:mod:`fedprob.flower.serverapp`) and ClientApp
(:mod:`fedprob.flower.clientapp`), and its ``[tool.flwr.app.config]`` carries
the fedprob TOML (``fedprob-config``, resolved by
:func:`fedprob.flower.spec.resolve`) and the run directory (``out-dir``).
fedprob must be installed where the SuperLink and the SuperNodes run.
``flwr run APP_DIR SUPERLINK`` submits it to a running SuperLink.
"""
from __future__ import annotations

from pathlib import Path

from ..toml_text import dumps
from . import spec


def _toml_str(s: str) -> str:
    """A TOML basic string of ``s`` (escaped, one line)."""
    out = s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n").replace("\t", "\\t")
    return f'"{out}"'


def write_app(cfg: dict, out, run_dir, name: str = "fedprob-app", force: bool = False) -> Path:
    """Write the Flower App for configuration ``cfg`` (a dict, as parsed) into ``out``; the
    ServerApp will write its run directory to ``run_dir`` (made absolute). Returns ``out``."""
    from .. import __version__ as _  # noqa: F401  (fedprob importable)

    text = dumps(cfg)
    spec.parse(text)
    resolved = dumps(spec.resolve(cfg))
    out = Path(out)
    if (out / "pyproject.toml").exists() and not force:
        raise FileExistsError(f"{out / 'pyproject.toml'} exists (pass --force to overwrite)")
    out.mkdir(parents=True, exist_ok=True)
    run_dir = Path(run_dir).resolve()
    (out / "pyproject.toml").write_text(f"""[build-system]
requires = ["hatchling"]
build-backend = "hatchling.build"

[project]
name = "{name}"
version = "1.0.0"
description = "A fedprob run as a Flower App (written by `fedprob flower app`)"
dependencies = ["fedprob"]

[tool.hatch.build.targets.wheel]
packages = ["."]

[tool.flwr.app]
publisher = "fedprob"

[tool.flwr.app.components]
serverapp = "fedprob.flower.serverapp:app"
clientapp = "fedprob.flower.clientapp:app"

[tool.flwr.app.config]
fedprob-config = {_toml_str(resolved)}
out-dir = {_toml_str(str(run_dir))}
""")
    (out / "fedprob.toml").write_text(resolved)
    return out


__all__ = ["write_app"]
