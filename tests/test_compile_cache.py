"""fedprob.compile_cache: where the persistent compilation cache goes, the opt-out, and that a
compiled program is written there."""
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from fedprob import compile_cache
from fedprob.cli import main

ROOT = Path(__file__).resolve().parents[1]


def test_cache_dir_default_path_and_opt_out(monkeypatch, tmp_path):
    monkeypatch.delenv(compile_cache.ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert compile_cache.cache_dir() == tmp_path / "fedprob" / "jax"
    assert compile_cache.cache_dir(tmp_path / "x") == tmp_path / "x"
    monkeypatch.setenv(compile_cache.ENV, str(tmp_path / "env"))
    assert compile_cache.cache_dir() == tmp_path / "env"
    for off in ("0", "off", "OFF", "false", "no"):
        monkeypatch.setenv(compile_cache.ENV, off)
        assert compile_cache.cache_dir() is None
        assert compile_cache.cache_dir(tmp_path) is None
        assert compile_cache.enable(tmp_path) is None


@pytest.fixture
def restore_cache_config():
    names = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
             "jax_persistent_cache_min_entry_size_bytes")
    before = {n: getattr(jax.config, n) for n in names}
    yield
    for n, v in before.items():
        jax.config.update(n, v)


def test_enable_writes_compiled_programs(tmp_path):
    """A fresh process (JAX sets its cache up at the first compile of a process): ``enable``
    points JAX at the directory and the compiled program is written there."""
    code = ("import jax, jax.numpy as jnp; from fedprob import compile_cache as c; d = c.enable(); "
            "assert jax.config.jax_compilation_cache_dir == str(d); "
            "assert jax.config.jax_persistent_cache_min_compile_time_secs == 0.0; "
            "print(float(jax.jit(lambda v: jnp.cumsum(jnp.sin(v) * 3.25) - 1.5)(jnp.arange(7.0))[0]))")
    env = dict(os.environ, **{compile_cache.ENV: str(tmp_path / "cc")})
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in [env.get("PYTHONPATH")] if p])
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert float(out.stdout.split()[-1]) == pytest.approx(-1.5)
    assert any(p.is_file() for p in (tmp_path / "cc").rglob("*"))


def test_cli_opt_out_leaves_the_cache_alone(monkeypatch, tmp_path, restore_cache_config):
    monkeypatch.setenv(compile_cache.ENV, "off")
    jax.config.update("jax_compilation_cache_dir", None)
    assert main(["run", str(tmp_path / "missing.toml")]) == 2     # fails early, after the cache setup
    assert jax.config.jax_compilation_cache_dir is None
    monkeypatch.setenv(compile_cache.ENV, str(tmp_path / "cli"))
    assert main(["run", str(tmp_path / "missing.toml")]) == 2
    assert jax.config.jax_compilation_cache_dir == str(tmp_path / "cli")


@pytest.mark.xla_optimized
def test_a_runtime_bound_test_compiles_at_the_usual_optimisation_level():
    """The tests' XLA flags compile at backend optimisation level 0; a test marked ``xla_optimized``
    (tests/conftest.py) passes level 2 with every compile, and an option a program sets itself wins."""
    from jax._src import compiler
    if "--xla_backend_optimization_level=0" not in os.environ.get("XLA_FLAGS", ""):
        pytest.skip("the tests' XLA flags are off (FEDPROB_TEST_XLA_O0=0 or XLA_FLAGS set)")
    opts = compiler.get_compile_options(num_replicas=1, num_partitions=1)
    assert ("xla_backend_optimization_level", 2) in list(opts.env_option_overrides)
    own = compiler.get_compile_options(num_replicas=1, num_partitions=1,
                                       env_options_overrides={"xla_backend_optimization_level": 1})
    assert ("xla_backend_optimization_level", 1) in list(own.env_option_overrides)
    f = jax.jit(lambda v: jnp.cumsum(jnp.sin(v) * 3.25) - 1.5)
    assert float(f(jnp.arange(7.0))[0]) == pytest.approx(-1.5)


def test_an_unmarked_test_keeps_the_fast_compile_flags():
    from jax._src import compiler
    opts = compiler.get_compile_options(num_replicas=1, num_partitions=1)
    assert all(k != "xla_backend_optimization_level" for k, _ in opts.env_option_overrides)
