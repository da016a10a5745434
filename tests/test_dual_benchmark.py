"""The dual-family benchmark's CI-sized run (``benchmarks/dual.py --quick``) on the real Credit data."""
import math

from test_benchmarks import load_script


def test_dual_benchmark_quick(data_root, capsys):
    res = load_script("dual").main(["--quick", "--data", str(data_root)])
    curve = res["problems"]["credit"]["FedLapCov"]
    assert len(curve["accuracy"]) == 2 and all(math.isfinite(a) for a in curve["nll"])
    # two rounds of FedLap-Cov already beat the majority class (55%) by a wide margin, at the mean and averaged
    assert curve["final_mean"]["accuracy"] > 0.75 and curve["final_average"]["accuracy"] > 0.75
    assert "credit" in capsys.readouterr().out
