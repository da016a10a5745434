"""``fedprob flower app``: a Flower App directory for a fedprob configuration.

The directory holds a ``pyproject.toml``: its ``[tool.flwr.app.components]``
point at fedprob's ServerApp (:mod:`fedprob.flower.serverapp`) and ClientApp
(:mod:`fedprob.flower.clientapp`, through ``fedprob_app/clientapp.py``, which
loads that file without importing the ``fedprob`` package: a node's
per-message process then imports no JAX), and its ``[tool.flwr.app.config]`` carries
the fedprob TOML (``fedprob-config``, resolved by
:func:`fedprob.flower.spec.resolve`) and the run directory (``out-dir``).
fedprob must be installed where the SuperLink and the SuperNodes run.
``flwr run APP_DIR SUPERLINK`` submits it to a running SuperLink.
"""
from __future__ import annotations

from pathlib import Path

from ..toml_text import dumps
from . import spec


CLIENTAPP = '''"""fedprob's ClientApp (fedprob/flower/clientapp.py), loaded without importing the fedprob package.

Flower starts a process per message; when the node runs fedprob's worker this process only
forwards the message, and importing fedprob (JAX, NumPyro) would cost it about a second.
"""
import importlib.util
import os

_pkg = importlib.util.find_spec("fedprob")
if _pkg is None:
    raise ImportError("fedprob is not installed on this SuperNode (pip install 'fedprob[flower]')")
_path = os.path.join(list(_pkg.submodule_search_locations)[0], "flower", "clientapp.py")
_spec = importlib.util.spec_from_file_location("fedprob_flower_clientapp", _path)
_module = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_module)
app = _module.app
'''


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
clientapp = "fedprob_app.clientapp:app"

[tool.flwr.app.config]
fedprob-config = {_toml_str(resolved)}
out-dir = {_toml_str(str(run_dir))}
""")
    (out / "fedprob.toml").write_text(resolved)
    (out / "fedprob_app").mkdir(exist_ok=True)
    (out / "fedprob_app" / "__init__.py").write_text('"""A fedprob run as a Flower App."""\n')
    (out / "fedprob_app" / "clientapp.py").write_text(CLIENTAPP)
    return out


__all__ = ["write_app"]
