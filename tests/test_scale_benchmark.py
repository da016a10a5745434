"""benchmarks/scale.py --quick: every table filled, every ratio positive and finite, no files written."""
from __future__ import annotations

import math
import time

from test_benchmarks import load_script


def positive_finite(x) -> bool:
    return isinstance(x, float) and math.isfinite(x) and x > 0


def test_scale_benchmark_quick(tmp_path):
    bench = load_script("scale")
    t0 = time.perf_counter()
    out = bench.main(["--quick", "--out", str(tmp_path)])
    wall = time.perf_counter() - t0
    assert not any(tmp_path.iterdir())          # --quick writes no result files
    assert out["meta"]["quick"] and "shared" in out["meta"]["shared_machine"]
    assert out["meta"]["device"] == "cpu" and out["meta"]["copy_GB_per_s"] > 0
    assert "--quick" in out["flower_note"]       # the Flower simulation is skipped and says why

    (orch,) = out["orchestration"]
    assert orch["clients"] == 10
    for k in ("local_round_ms", "local_round_best_ms", "local_startup_s"):
        assert positive_finite(orch[k]), (k, orch)

    assert [r["clients"] for r in out["clients"]] == [10, 100]
    for r in out["clients"]:
        for k in ("round_s", "us_per_client_step", "us_per_client_step_best", "per_client_step_vs_first"):
            assert positive_finite(r[k]), (k, r)
        # us per client-step is the round time over clients * steps
        assert math.isclose(r["us_per_client_step"], 1e6 * r["round_s"] / (r["clients"] * r["steps"]))
        assert math.isclose(r["client_steps_per_s"], 1e6 / r["us_per_client_step"])
        assert r["bandwidth_fraction"] > 0 and r["floor_bytes_per_client_step"] > 4 * (8 * 10 + 11)
        assert math.isclose(r["bandwidth_fraction"], r["floor_bytes_per_client_step"] * r["client_steps_per_s"]
                            / (out["meta"]["copy_GB_per_s"] * 1e9))
    assert out["clients"][0]["per_client_step_vs_first"] == 1.0

    assert len(out["memory"]) == 2
    for r in out["memory"]:
        for k in ("argument_MB", "output_MB", "temp_MB"):
            assert positive_finite(r[k]), (k, r)
    # 10 times the clients: 10 times the data handed in
    small, large = out["memory"]
    assert math.isclose(large["argument_MB"] / small["argument_MB"], 10.0, rel_tol=0.05)

    (step,) = out["steps"]
    assert step["sampler"] == "SGLD" and step["batch"] == 64 and step["finite"]
    for k in ("step_us", "bare_gradient_us", "floor_us", "over_gradient", "over_floor",
              "over_floor_best", "over_floor_wall", "floor_over_gradient", "steps_per_s", "bandwidth_fraction"):
        assert positive_finite(step[k]), (k, step)
    assert step["clock"] == "process CPU"          # the CPU backend: CPU time is the primary clock
    assert math.isclose(step["steps_per_s"], 1e6 / step["step_us"])
    # a step's traffic: at least the 64-row minibatch and the 650 parameters it reads, in float32
    assert step["floor_bytes_per_step"] > 4 * (64 * 64 + 650)
    assert math.isclose(step["bandwidth_fraction"],
                        step["floor_bytes_per_step"] * step["steps_per_s"] / (out["meta"]["copy_GB_per_s"] * 1e9))
    print(f"scale --quick: {wall:.1f} s")
