"""fedprob on Flower's Deployment Engine: node files, certificates, the app, the strategy, real processes.

The process test starts a SuperLink (TLS, SuperNode authentication) and
SuperNodes as separate processes on free local ports, each node holding its
own ``.npz``, and runs PVI and EP-MCMC through ``flwr run``: the local
engine's answer, an unregistered node refused, no reply with a row dimension.
"""
import importlib.util
import json
import time
import tomllib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fedprob as fp

pytestmark = [pytest.mark.skipif(importlib.util.find_spec("flwr") is None
                                 or importlib.util.find_spec("cryptography") is None,
                                 reason="needs flwr and cryptography (pip install 'fedprob[flower]')"),
              pytest.mark.processes]   # a SuperLink, SuperNodes and their workers at once

SIZES = (40, 55, 55)          # no parameter dimension equals a row count
#: the default run's real-process federation: two registered nodes (and the stranger); the slow tests
#: run on three (a round's first compile happens on every node at once: one fewer on 2 cores)
SMALL_SIZES = (40, 55)
MODEL = {"name": "linear_regression", "noise_scale": 0.5, "bias": False}


def _fed(sizes=SIZES):
    rng = np.random.default_rng(0)
    n = sum(sizes)
    X = rng.normal(size=(n, 3)).astype(np.float32)
    y = (X @ np.array([1.0, -2.0, 0.5]) + 0.5 * rng.normal(size=n)).astype(np.float32)
    cuts = np.cumsum((0,) + tuple(sizes))
    return fp.data.FederatedData.from_clients([(X[a:b], y[a:b]) for a, b in zip(cuts[:-1], cuts[1:])])


def _files(tmp, fed):
    from fedprob.flower import nodedata

    return [nodedata.write(tmp / f"client_{k}.npz", *fed.client(k), client=k) for k in range(fed.num_clients)]


def _model():
    return fp.models.linear_regression(noise_scale=0.5, bias=False)


# ---- a federation's start: what it waits for -----------------------------------------------------------
def test_nodes_count_as_connected_from_their_logs_since_their_last_start(tmp_path):
    """LocalFederation asks the SuperLink about its nodes once their logs say they were accepted: a node
    restarted (its log appended to) counts again only once its new run logs the line, a node whose
    process has ended does not count, and a port counts once something listens on it."""
    import os
    import socket
    import sys

    from fedprob.flower import local

    f = local.LocalFederation(tmp_path / "fed", [])
    f.env = dict(os.environ)
    say = "import sys; print(sys.argv[1], flush=True); import time; time.sleep(30)"
    try:
        f._spawn("node_0", [sys.executable, "-c", say, local.NODE_CONNECTED + " 1"])
        f._spawn("node_1", [sys.executable, "-c", say, "starting"])
        f._spawn("superlink", [sys.executable, "-c", say, local.NODE_CONNECTED + " 3"])   # not a node
        deadline = time.monotonic() + 30
        while f._connected_nodes() < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.3)
        assert f._connected_nodes() == 1
        # node 0 restarts: the old line stays in its log but no longer counts
        f.procs["node_0"].kill()
        f.procs["node_0"].wait()
        assert f._connected_nodes() == 0                      # an ended process does not count
        f._spawn("node_0", [sys.executable, "-c", say, "starting again"])
        time.sleep(0.5)
        assert local.NODE_CONNECTED in f.log("node_0") and f._connected_nodes() == 0
    finally:
        f.close()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        assert not local._accepts(port)
        s.listen()
        assert local._accepts(port)


# ---- node files -------------------------------------------------------------------------------------
def test_node_file_checks_and_padding(tmp_path):
    from fedprob.flower import nodedata

    fed = _fed()
    path = _files(tmp_path, fed)[0]
    rows = nodedata.load(path)
    assert rows["client"] == 0 and rows["X"].shape == (40, 3)
    X, y = nodedata.padded(rows, 55)
    np.testing.assert_array_equal(X, fed.X[0])
    np.testing.assert_array_equal(y, fed.y[0])
    nodedata.check_against(rows, _model())
    np.savez(tmp_path / "no_y.npz", X=rows["X"])
    with pytest.raises(ValueError, match="no y"):
        nodedata.load(tmp_path / "no_y.npz")
    np.savez(tmp_path / "rows.npz", X=rows["X"], y=rows["y"][:5])
    with pytest.raises(ValueError, match="same number of rows"):
        nodedata.load(tmp_path / "rows.npz")
    bad = rows["X"].copy()
    bad[3, 1] = np.nan
    np.savez(tmp_path / "nan.npz", X=bad, y=rows["y"])
    with pytest.raises(ValueError, match="non-finite"):
        nodedata.load(tmp_path / "nan.npz")
    np.savez(tmp_path / "labels.npz", X=rows["X"], y=np.full(40, 7))
    with pytest.raises(ValueError, match=r"labels must be in \[0, 3\)"):
        nodedata.check_against(nodedata.load(tmp_path / "labels.npz"), fp.models.softmax_regression(3), None, 3)
    np.savez(tmp_path / "wide.npz", X=rows["X"], y=np.zeros((40, 2), np.float32))
    with pytest.raises(ValueError, match="does not fit the model"):
        nodedata.check_against(nodedata.load(tmp_path / "wide.npz"), _model())


def test_certificates_chain_and_node_keys(tmp_path):
    from cryptography import x509
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.hazmat.primitives.serialization import load_ssh_private_key, load_ssh_public_key

    from fedprob.flower.certs import make_certs

    p = make_certs(tmp_path / "c", hosts=["superlink.example.org", "10.1.2.3"], nodes=2)
    ca = x509.load_pem_x509_certificate(p["ca"].read_bytes())
    srv = x509.load_pem_x509_certificate(p["server_cert"].read_bytes())
    ca.public_key().verify(srv.signature, srv.tbs_certificate_bytes, ec.ECDSA(srv.signature_hash_algorithm))
    san = srv.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert "superlink.example.org" in san.get_values_for_type(x509.DNSName)
    assert "10.1.2.3" in [str(a) for a in san.get_values_for_type(x509.IPAddress)]
    key = load_ssh_private_key(p["node_keys"][1].read_bytes(), None)
    assert isinstance(key, ec.EllipticCurvePrivateKey)
    assert load_ssh_public_key(p["node_pubs"][1].read_bytes()).public_numbers() == key.public_key().public_numbers()
    assert oct(p["node_keys"][0].stat().st_mode & 0o777) == "0o600"
    with pytest.raises(FileExistsError):
        make_certs(tmp_path / "c")


def test_app_directory_carries_the_configuration(tmp_path):
    from fedprob.flower import spec
    from fedprob.flower.appdir import write_app

    cfg = {"data": {"name": "digits"}, "partition": {"num_clients": 4}, "model": {"name": "softmax_regression"},
           "algorithm": {"name": "FedAvg"}, "engine": {"name": "local"}}
    app = write_app(cfg, tmp_path / "app", tmp_path / "run")
    pp = tomllib.loads((app / "pyproject.toml").read_text())
    assert pp["tool"]["flwr"]["app"]["components"] == {"serverapp": "fedprob.flower.serverapp:app",
                                                        "clientapp": "fedprob_app.clientapp:app"}
    import subprocess
    import sys

    probe = ("import sys; sys.path.insert(0, sys.argv[1]); from fedprob_app.clientapp import app; "
             "from flwr.clientapp import ClientApp; assert isinstance(app, ClientApp); "
             "assert 'jax' not in sys.modules and 'fedprob' not in sys.modules")
    subprocess.run([sys.executable, "-c", probe, str(app)], check=True, timeout=60)
    conf = pp["tool"]["flwr"]["app"]["config"]
    inner = spec.parse(conf["fedprob-config"])
    assert inner["model"] == {"name": "softmax_regression", "num_classes": 10}   # filled in from the data set
    assert "engine" not in inner and conf["out-dir"] == str((tmp_path / "run").resolve())
    with pytest.raises(FileExistsError):
        write_app(cfg, tmp_path / "app", tmp_path / "run")
    with pytest.raises(ValueError, match="unknown key 'rounds' in \\[flower\\]"):
        spec.parse('[model]\nname = "linear_regression"\n[algorithm]\nname = "PVI"\n[flower]\nrounds = 3\n')


def test_flower_command_line(tmp_path, capsys):
    from fedprob.cli import main
    from fedprob.flower import nodedata, spec

    cfg = tmp_path / "digits.toml"
    cfg.write_text('[data]\nname = "digits"\n[partition]\nnum_clients = 3\n[model]\nname = "softmax_regression"'
                   '\n[algorithm]\nname = "PVI"\n[flower]\non_missing = "drop"\n')
    assert main(["flower", "split", str(cfg), "--out", str(tmp_path / "data")]) == 0
    fed, _ = spec.federation(spec.parse(cfg.read_text()))
    for k in range(3):
        rows = nodedata.load(tmp_path / "data" / f"client_{k}.npz")
        assert rows["client"] == k
        np.testing.assert_array_equal(rows["X"], fed.client(k)[0])
        np.testing.assert_array_equal(rows["y"], fed.client(k)[1])
    assert main(["flower", "app", str(cfg), "--out", str(tmp_path / "app")]) == 0
    assert "flwr run" in capsys.readouterr().out
    assert main(["flower", "certs", str(tmp_path / "certs"), "--nodes", "2"]) == 0
    assert (tmp_path / "certs" / "node_1.pub").exists()
    assert main(["flower", "supernode", "--superlink", "127.0.0.1:1", "--data", str(tmp_path / "x.npz")]) == 2
    assert "--root-certificates" in capsys.readouterr().err


# ---- the strategy, in this process ----------------------------------------------------------------------
@pytest.fixture(autouse=True)
def _task_identity():
    """Flower's messages read the run and node ids of the process (set by Flower's own processes)."""
    from flwr.supercore.task_identity import TaskIdentity

    saved = (TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id)
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1
    yield
    TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id = saved


class InProcessGrid:
    """A Flower Grid whose nodes are :class:`fedprob.flower.node.NodeCompute` objects in this process;
    ``drop(round, client)`` / ``corrupt(round, client)`` decide which replies go missing or malformed."""

    def __init__(self, paths, drop=lambda r, k: False, corrupt=lambda r, k: False):
        from fedprob.flower.node import NodeCompute

        self.nodes = {1000 + 7 * i: NodeCompute(str(p)) for i, p in enumerate(paths)}
        self.drop, self.corrupt = drop, corrupt
        self.sent = []

    def get_node_ids(self):
        return list(self.nodes)

    def send_and_receive(self, messages, timeout=None):
        from flwr.app import Message

        from fedprob.flower.clientapp import reply_content, request_of

        out = []
        for m in messages:
            m.metadata.__dict__["_message_id"] = m.object_id
            req = request_of(m)
            self.sent.append(req)
            k, r = req["meta"].get("client"), req["meta"].get("round")
            if req["type"] == "train" and self.drop(r, k):
                continue
            reply = self.nodes[m.metadata.dst_node_id].handle(req)
            if req["type"] == "train" and self.corrupt(r, k):
                reply["arrays"]["reply"][1] = np.full_like(reply["arrays"]["reply"][1], np.nan)
                reply["arrays"]["reply"][0] = reply["arrays"]["reply"][0][:1]
            out.append(Message(reply_content(reply), reply_to=m))
        return out


def _strategy(**kw):
    from fedprob.flower.strategy import strategy

    return strategy("PVI", "linear_regression", {"noise_scale": 0.5, "bias": False}, num_nodes=3, rounds=3,
                    node_wait_s=5, **kw)


def test_strategy_reproduces_the_local_engine_in_process(tmp_path):
    fed = _fed()
    grid = InProcessGrid(_files(tmp_path, fed)[::-1])
    s = _strategy()
    s.start(grid)
    local = fp.run(fp.algorithms.PVI(), _model(), fed, rounds=3, seed=0, progress=False)
    np.testing.assert_allclose(np.asarray(s.posterior().mean["w"]), np.asarray(local.posterior.mean["w"]),
                               rtol=1e-5, atol=1e-6)
    assert [h["participants"] for h in s.history] == [[0, 1, 2]] * 3
    # the rows never travel: no array of any message has a row dimension
    for req in grid.sent:
        for leaves in req["arrays"].values():
            assert all(n not in np.shape(a) for a in leaves for n in (40, 55))
    for _, _, shapes in s.reply_shapes:
        assert all(n not in sh for sh in shapes for n in (40, 55))


def test_missing_and_malformed_replies_follow_the_policy(tmp_path):
    paths = _files(tmp_path, _fed())
    s = _strategy(on_missing="drop")
    s.start(InProcessGrid(paths, drop=lambda r, k: r == 1 and k == 2, corrupt=lambda r, k: r == 2 and k == 0))
    h = s.history
    assert h[1]["missing"] == [2] and h[1]["excluded"] == [2]
    assert h[2]["quarantined"] == [0] and 0 in h[2]["excluded"] and "missing" not in h[2]
    assert h[0].get("excluded", []) == [] and np.all(np.isfinite(np.asarray(s.posterior().mean["w"])))
    # a node that comes back catches up: client 2 is in again in round 3 (it was sent its kept state)
    assert 2 not in h[2]["excluded"]
    with pytest.raises(RuntimeError, match=r"round 2: Flower node 1014 sent no reply .* for client 2"):
        _strategy(on_missing="error").start(InProcessGrid(paths, drop=lambda r, k: r == 1 and k == 2))


def test_flowers_dp_wrapper_does_not_compose_and_its_replies_are_quarantined(tmp_path):
    """Flower's server-side DP wrapper rewrites each reply as global arrays + a clipped difference
    with unrelated arrays, or raises where their counts differ (its strict zip): fedprob's checks
    quarantine every rewritten reply, and in either case nothing is aggregated (documented: use
    GaussianDP)."""
    from flwr.serverapp.strategy import DifferentialPrivacyServerSideFixedClipping

    from fedprob.flower.strategy import _record

    grid = InProcessGrid(_files(tmp_path, _fed()))
    s = _strategy()
    s.setup(grid)
    before = np.asarray(s.posterior().mean["w"])
    w = DifferentialPrivacyServerSideFixedClipping(s, noise_multiplier=0.1, clipping_norm=1.0,
                                                   num_sampled_clients=3)
    replies = grid.send_and_receive(list(w.configure_train(1, _record(s.server), None, grid)))
    counts = {len(r.content.array_records[k]) for r in replies for k in r.content.array_records}
    if counts == {len(_record(s.server))}:
        w.aggregate_train(1, replies)
        assert s.history[-1]["quarantined"] == [0, 1, 2] and not s.history[-1]["server_update_ok"]
    else:
        with pytest.raises(ValueError, match="shorter|longer"):
            w.aggregate_train(1, replies)
    np.testing.assert_array_equal(np.asarray(s.posterior().mean["w"]), before)


def test_a_row_reading_init_is_refused(tmp_path):
    from fedprob.flower.strategy import strategy

    s = strategy("FedLapFunc", "linear_regression", {"noise_scale": 0.5, "bias": False}, num_nodes=3,
                 node_wait_s=5) if hasattr(fp.algorithms, "FedLapFunc") else None
    if s is None:
        pytest.skip("no algorithm whose init reads rows")
    with pytest.raises(ValueError, match="init reads the clients' rows"):
        s.start(InProcessGrid(_files(tmp_path, _fed())))


# ---- real processes: a SuperLink and SuperNodes on local ports -----------------------------------------
def _start_federation(tmp_path_factory, sizes):
    """A SuperLink (TLS, SuperNode authentication) and one SuperNode process per client of ``sizes``,
    each registered and holding its client's file, plus one whose key was never registered."""
    import shutil

    from fedprob.flower.local import LocalFederation

    tmp = tmp_path_factory.mktemp("deployment")
    fed = _fed(sizes)
    paths = _files(tmp / "data", fed)
    stranger = tmp / "data" / "stranger.npz"
    shutil.copy(paths[0], stranger)
    f = LocalFederation(tmp / "fed", paths + [stranger], register=[True] * len(paths) + [False], timeout=120)
    try:
        f.start()
        yield f, fed, tmp
    finally:
        f.close()


@pytest.fixture(scope="module")
def federation(tmp_path_factory):
    """Three registered SuperNodes (clients of 40, 55 and 55 rows) and the stranger."""
    yield from _start_federation(tmp_path_factory, SIZES)


@pytest.fixture(scope="module")
def small_federation(tmp_path_factory):
    """Two registered SuperNodes (clients of 40 and 55 rows) and the stranger."""
    yield from _start_federation(tmp_path_factory, SMALL_SIZES)


def _run_app(f, tmp, name, algorithm: dict, client=None, flower=None, on_line=None):
    from fedprob.flower.appdir import write_app

    cfg = {"model": dict(MODEL), "algorithm": algorithm, "run": {"seed": 0},
           "flower": {"num_nodes": len(f.node_ids), "evaluate": False, **(flower or {})}}
    if client:
        cfg["client"] = client
    if "rounds" in algorithm:
        cfg["run"]["rounds"] = cfg["algorithm"].pop("rounds")
    app = write_app(cfg, tmp / f"app_{name}", tmp / f"run_{name}")
    out = f.run(app, timeout=400, on_line=on_line)
    run = tmp / f"run_{name}"
    post = np.load(run / "posterior.npz")
    return out, run, post, json.loads((run / "deployment.json").read_text()), \
        json.loads((run / "history.json").read_text())


def _no_row_dimension(dep, sizes=SIZES):
    assert dep["reply_shapes"], "no replies recorded"
    for _, _, shapes in dep["reply_shapes"]:
        assert all(n not in sh for sh in shapes for n in sizes), shapes


def test_deployment_engine_with_tls_and_node_authentication(small_federation):
    """Two registered SuperNodes and one stranger (the slow tests' federation has three registered)."""
    f, fed, tmp = small_federation
    # the unregistered node is refused by the SuperLink, the registered ones are online
    online = f.wait_online(2, timeout=120)
    assert sorted(online) == sorted(f.node_ids.values())
    stranger = f.procs["node_2"]
    stranger.wait(timeout=120)
    assert stranger.returncode != 0
    assert "Failed to activate SuperNode" in f.log("node_2")
    # PVI, 2 rounds (the second with the nodes' kept client update), through `flwr run`: the local
    # engine's answer
    out, run, post, dep, hist = _run_app(f, tmp, "pvi", {"name": "PVI", "rounds": 2})
    assert "fedprob: round 2/2 done" in out            # progress streams to the flwr run terminal
    local = fp.run(fp.algorithms.PVI(), _model(), fed, rounds=2, seed=0, progress=False)
    np.testing.assert_allclose(post["mean/w"], np.asarray(local.posterior.mean["w"]), rtol=1e-4, atol=1e-5)
    assert [h["round"] for h in hist] == [1, 2] and sorted(dep["client_sizes"]) == sorted(SMALL_SIZES)
    assert sorted(dep["nodes"]) == sorted(f.node_ids.values())
    _no_row_dimension(dep, SMALL_SIZES)
    from fedprob.rundir import load_runs

    assert load_runs(run)[0]["name"] == "PVI"           # `fedprob report` reads it


@pytest.mark.slow
def test_deployment_engine_runs_a_one_round_product(federation):
    """EP-MCMC with Laplace clients through `flwr run`: the local engine's answer and the exact conjugate
    posterior (slow: a second app on the same federation; the default run's version is the PVI app of
    test_deployment_engine_with_tls_and_node_authentication; EP-MCMC with Laplace clients through the Flower
    engine's grid is checked against the local engine in tests/test_flower.py)."""
    f, fed, tmp = federation
    f.wait_online(3, timeout=120)
    out, run, post, dep, hist = _run_app(f, tmp, "epmcmc", {"name": "EPMCMC"}, client={"name": "Laplace"})
    local = fp.run(fp.algorithms.EPMCMC(client=fp.inference.Laplace()), _model(), fed, progress=False)
    np.testing.assert_allclose(post["mean/w"], np.asarray(local.posterior.mean["w"]), rtol=1e-4, atol=1e-5)
    X, y = fed.pooled()
    P = np.eye(3) + X.T.astype(float) @ X / 0.25
    np.testing.assert_allclose(post["mean/w"], np.linalg.solve(P, X.T.astype(float) @ y / 0.25), rtol=1e-3,
                               atol=1e-4)
    _no_row_dimension(dep)


ROUNDS_STOPPED = 15      # a round takes about a second: room for the node's process to come back


@pytest.mark.slow
def test_a_stopped_supernode_is_left_out_and_catches_up(federation):
    """Slow (70 s: 15 real rounds, so the node's process has time to come back). Its default-run version
    is test_missing_and_malformed_replies_follow_the_policy: the same strategy, a reply missing in
    round 2, the node left out, then sent its kept state and included again."""
    f, fed, tmp = federation
    f.wait_online(3, timeout=120)

    def on_line(line):
        if f"fedprob: round 2/{ROUNDS_STOPPED} done" in line:
            f.stop_node(2)
        elif f"fedprob: round 3/{ROUNDS_STOPPED} done" in line:
            f.start_node(2)

    out, run, post, dep, hist = _run_app(f, tmp, "stopped", {"name": "PVI", "rounds": ROUNDS_STOPPED},
                                         flower={"on_missing": "drop", "round_timeout_s": 60.0},
                                         on_line=on_line)
    assert "missing" not in hist[1] and hist[2]["missing"] == [2] and 2 in hist[2]["excluded"]
    assert "Node Unavailable" in hist[2]["missing_errors"]["2"]     # the SuperLink's answer for it
    # back once its process is up again (a round or two), sent its kept state: it catches up
    back = [h["round"] for h in hist[3:] if 2 not in h.get("excluded", [])]
    assert back and back == list(range(back[0], ROUNDS_STOPPED + 1)), [h.get("excluded") for h in hist]
    assert np.all(np.isfinite(post["mean/w"]))
