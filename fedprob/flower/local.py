"""Processes of a Flower federation: a SuperNode with fedprob's worker, and a whole federation on one machine.

* :func:`supernode` (``fedprob flower supernode``): one data holder's node:
  fedprob's long-lived worker (:mod:`.worker`) in this process, Flower's
  ``flower-supernode`` as a child process connected to the SuperLink, with
  TLS (``root_certificates``) and node authentication (``auth_key``), or
  ``insecure=True`` (with a warning).
* :class:`LocalFederation` (``fedprob flower local`` and the tests): a
  SuperLink with TLS and SuperNode authentication, certificates from
  :mod:`.certs`, one registered SuperNode per ``.npz`` file, each a separate
  process on free local ports; :meth:`LocalFederation.run` submits an app
  with ``flwr run`` and streams its log. Flower's CLI configuration lives in
  the federation's own ``FLWR_HOME`` (``<dir>/flwr-home``), under the
  connection name ``fedprob-local``. Every process is ended by :meth:`close`.
"""
from __future__ import annotations

import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import warnings
from pathlib import Path

CONNECTION = "fedprob-local"
#: the line Flower's SuperNode logs once the SuperLink has accepted it (``flwr`` 1.41); a node whose log
#: shows it is asked about by one ``flwr supernode list`` instead of a poll of them
NODE_CONNECTED = "SuperNode ID:"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def flower_env(flwr_home=None) -> dict:
    """The environment Flower's processes run with: this interpreter's scripts on PATH, no telemetry,
    no runtime dependency installation."""
    env = dict(os.environ)
    bindir = str(Path(sys.executable).parent)
    env["PATH"] = bindir + os.pathsep + env.get("PATH", "")
    env["FLWR_TELEMETRY_ENABLED"] = "0"
    env["FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION"] = "1"
    env.setdefault("FLWR_SUPEREXEC_TASK_POLL_INTERVAL", "0.1")   # Flower's default: 1 s per launch
    if flwr_home is not None:
        env["FLWR_HOME"] = str(flwr_home)
    return env


def _exe(name: str) -> str:
    p = Path(sys.executable).parent / name
    return str(p) if p.exists() else name


def supernode_command(superlink: str, node_config: str, root_certificates=None, auth_key=None,
                      insecure: bool = False, port=None, prompt: bool = False) -> list:
    """Flower's SuperNode command line; ``prompt=True`` runs it through :mod:`.polling`, which
    shortens the SuperNode's fixed 3 s wait between pulls."""
    exe = [sys.executable, "-m", "fedprob.flower.polling"] if prompt else [_exe("flower-supernode")]
    cmd = exe + ["--superlink", superlink, "--node-config", node_config, "--port", str(port or free_port())]
    if insecure:
        cmd.append("--insecure")
    else:
        if root_certificates is None:
            raise ValueError("a SuperNode needs --root-certificates (the federation's ca.crt) or --insecure")
        cmd += ["--root-certificates", str(root_certificates)]
    if auth_key is not None:
        cmd += ["--auth-supernode-private-key", str(auth_key)]
    return cmd


def supernode(superlink: str, data_path, root_certificates=None, auth_key=None, insecure: bool = False,
              port=None, log=None) -> int:
    """Run one node until Flower's SuperNode exits: fedprob's worker here, ``flower-supernode`` as a
    child; returns the SuperNode's exit status."""
    import threading
    from multiprocessing.connection import Listener

    from . import nodedata
    from .worker import serve

    if insecure:
        warnings.warn("insecure SuperNode: no TLS, messages travel in clear text", stacklevel=2)
    nodedata.load(data_path)                        # a bad file fails here, before connecting
    key = secrets.token_bytes(32)
    listener = Listener(("127.0.0.1", 0), authkey=key)
    host, wport = listener.address
    config = f"data-path='{Path(data_path).resolve()}' worker='{host}:{wport}' worker-key='{key.hex()}'"
    cmd = supernode_command(superlink, config, root_certificates, auth_key, insecure, port, prompt=True)
    proc = subprocess.Popen(cmd, env=flower_env(), stdout=log, stderr=subprocess.STDOUT if log else None,
                            start_new_session=True)
    t = threading.Thread(target=serve, args=(str(data_path), listener), daemon=True)
    t.start()
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))   # stop the SuperNode with us
    try:
        return proc.wait()
    finally:
        _stop(proc)
        listener.close()
        signal.signal(signal.SIGTERM, previous)


#: :meth:`LocalFederation.wait_online` asks the SuperLink at least this often (seconds)
ASK_EVERY_S = 5.0


def _accepts(port: int) -> bool:
    """Whether something listens on the local ``port``."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


def _signal_session(proc, sig) -> None:
    """Send ``sig`` to ``proc`` and the processes it started (its own session), or to ``proc`` alone."""
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        proc.send_signal(sig)


def _stop(proc, timeout: float = 10.0) -> None:
    """End ``proc`` and the processes it started (its own session)."""
    if proc is None or proc.poll() is not None:
        return
    _signal_session(proc, signal.SIGTERM)
    _wait_or_kill(proc, timeout)


def _wait_or_kill(proc, timeout: float) -> None:
    """Wait up to ``timeout`` s for ``proc``, then kill its session and wait (up to 10 s or ``timeout``)."""
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        _signal_session(proc, signal.SIGKILL)
        proc.wait(max(timeout, 10.0))


class LocalFederation:
    """A SuperLink and one SuperNode per data file on this machine (module docstring).

    ``with LocalFederation(dir, data_paths) as fed: fed.run(app_dir)``. ``dir`` holds the
    certificates (``certs/``), Flower's home (``flwr-home/``) and one log per process
    (``logs/``). ``register=False`` for a node index leaves it unregistered (it is refused).
    ``worker=False`` starts Flower's plain SuperNodes (``data-path`` only: the ClientApp then
    computes in Flower's per-message process, importing JAX and compiling every round).
    """

    def __init__(self, workdir, data_paths, register=None, timeout: float = 60.0, worker: bool = True):
        self.dir = Path(workdir)
        self.data_paths = [Path(p).resolve() for p in data_paths]
        self.register = [True] * len(self.data_paths) if register is None else list(register)
        self.timeout = timeout
        self.worker = worker
        self.procs: dict = {}
        self.node_ids: dict = {}
        self.logs = self.dir / "logs"
        self._log_start: dict = {}

    # ---- processes -----------------------------------------------------------------------------------
    def _spawn(self, name, cmd, env=None):
        self.logs.mkdir(parents=True, exist_ok=True)
        path = self._log_path(name)
        self._log_start[name] = path.stat().st_size if path.exists() else 0   # a restart appends
        f = open(path, "ab")
        proc = subprocess.Popen(cmd, env=env or self.env, stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True, cwd=self.dir)
        f.close()
        self.procs[name] = proc
        return proc

    def _log_path(self, name) -> Path:
        return self.logs / f"{name}.log"

    def log(self, name) -> str:
        p = self._log_path(name)
        return p.read_text(errors="replace") if p.exists() else ""

    def _logged_since_start(self, name, text: str) -> bool:
        """Whether process ``name`` has logged ``text`` since it was last started."""
        try:
            with open(self._log_path(name), "rb") as f:
                f.seek(self._log_start.get(name, 0))
                return text.encode() in f.read()
        except OSError:
            return False

    def _connected_nodes(self) -> int:
        """Running SuperNode processes whose log says the SuperLink accepted them."""
        return sum(1 for name, p in self.procs.items()
                   if name.startswith("node_") and p.poll() is None and self._logged_since_start(name, NODE_CONNECTED))

    def _flwr(self, *args, timeout=None):
        return subprocess.run([_exe("flwr"), *map(str, args)], env=self.env, capture_output=True, text=True,
                              timeout=timeout or self.timeout, cwd=self.dir)

    def start(self):
        from .certs import make_certs

        self.dir.mkdir(parents=True, exist_ok=True)
        self.certs = make_certs(self.dir / "certs", nodes=len(self.data_paths))
        home = self.dir / "flwr-home"
        home.mkdir(exist_ok=True)
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        (home / "config.toml").write_text(
            f'[superlink]\ndefault = "{CONNECTION}"\n\n[superlink.{CONNECTION}]\naddress = "{self.address}"\n'
            f'root-certificates = "{self.certs["ca"]}"\n')
        self.env = flower_env(home)
        c = self.certs
        self._spawn("superlink", [_exe("flower-superlink"), "--ssl-ca-certfile", c["ca"], "--ssl-certfile",
                                  c["server_cert"], "--ssl-keyfile", c["server_key"], "--enable-supernode-auth",
                                  "--disable-runtime-dependency-installation", "--host", "127.0.0.1",
                                  "--port", str(self.port)])
        self._wait_superlink()
        from concurrent.futures import ThreadPoolExecutor

        todo = [i for i, ok in enumerate(self.register) if ok]
        with ThreadPoolExecutor(max(len(todo), 1)) as pool:        # one `flwr` process per key, side by side
            ids = list(pool.map(lambda i: self.register_node(c["node_pubs"][i]), todo))
        self.node_ids.update(zip(todo, ids))
        for i in range(len(self.data_paths)):
            self.start_node(i)
        return self

    def _wait_superlink(self):
        """Until the SuperLink answers ``flwr supernode list``; asked once its port accepts connections (each
        ``flwr`` command is a process of its own: about 1.5 s of a core)."""
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            if self.procs["superlink"].poll() is not None:
                raise RuntimeError(f"the SuperLink exited:\n{self.log('superlink')[-3000:]}")
            if not _accepts(self.port):
                time.sleep(0.1)
                continue
            r = self._flwr("supernode", "list", CONNECTION, "--format", "json", timeout=30)
            if r.returncode == 0 and '"success": true' in r.stdout:
                return
            time.sleep(0.5)
        raise TimeoutError(f"the SuperLink did not answer within {self.timeout:.0f} s")

    def register_node(self, pub) -> int:
        import json

        r = self._flwr("supernode", "register", pub, CONNECTION, "--format", "json")
        out = json.loads(r.stdout[r.stdout.index("{"):]) if "{" in r.stdout else {}
        if not out.get("success"):
            raise RuntimeError(f"registering {pub} failed: {r.stdout} {r.stderr}")
        return int(out["node-id"])

    def start_node(self, i: int):
        """Start (or restart) node ``i``: ``fedprob flower supernode`` with its file and key."""
        name = f"node_{i}"
        old = self.procs.get(name)
        if old is not None and old.poll() is None:
            return old
        if not self.worker:
            return self._spawn(name, supernode_command(
                self.address, f"data-path='{self.data_paths[i]}'", self.certs["ca"], self.certs["node_keys"][i]))
        cmd = [sys.executable, "-m", "fedprob.cli", "flower", "supernode", "--superlink", self.address,
               "--data", str(self.data_paths[i]), "--root-certificates", str(self.certs["ca"]),
               "--auth-key", str(self.certs["node_keys"][i])]
        return self._spawn(name, cmd)

    def stop_node(self, i: int):
        _stop(self.procs.get(f"node_{i}"))

    def wait_online(self, count: int, timeout=None) -> list:
        """Node ids once ``count`` nodes are online. The SuperLink is asked (``flwr supernode list``) once
        ``count`` nodes' logs say they were accepted, and every :data:`ASK_EVERY_S` seconds regardless (a
        Flower release that logs otherwise); in between, the logs are read every 0.1 s."""
        import json

        deadline = time.monotonic() + (timeout or self.timeout)
        online, asked = [], time.monotonic()
        while time.monotonic() < deadline:
            if self._connected_nodes() < count and time.monotonic() - asked < ASK_EVERY_S:
                time.sleep(0.1)
                continue
            asked = time.monotonic()
            r = self._flwr("supernode", "list", CONNECTION, "--format", "json", timeout=30)
            if r.returncode == 0:
                nodes = json.loads(r.stdout[r.stdout.index("{"):]).get("nodes", [])
                online = [int(n["node-id"]) for n in nodes if n.get("status") == "online"]
                if len(online) >= count:
                    return online
            time.sleep(0.5)
        raise TimeoutError(f"{len(online)} of {count} SuperNodes online after {timeout or self.timeout:.0f} s")

    def run(self, app_dir, timeout: float = 600.0, run_config=None, echo: bool = False, on_line=None) -> str:
        """``flwr run APP_DIR fedprob-local --stream``: its output (a RuntimeError with it on failure);
        ``on_line(line)`` sees each line as it comes."""
        args = [_exe("flwr"), "run", str(app_dir), CONNECTION, "--stream"]
        if run_config:
            args += ["--run-config", run_config]
        proc = subprocess.Popen(args, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                cwd=self.dir, start_new_session=True)
        import threading

        lines = []
        timer = threading.Timer(timeout, _stop, (proc, 5.0))
        timer.start()
        try:
            for line in proc.stdout:
                lines.append(line)
                if echo:
                    print(line, end="", flush=True)
                if on_line is not None:
                    on_line(line)
                if "fedprob:" in line and "run directory:" in line:
                    break
        finally:
            timer.cancel()
            _stop(proc, 5.0)
        out = "".join(lines)
        if "run directory:" not in out:
            raise RuntimeError(f"flwr run failed or timed out ({timeout:.0f} s):\n{out[-4000:]}")
        return out

    def close(self):
        """Stop every process at once (each its own session), then wait for them: stopping them one by one
        waited for each in turn (18 s for a SuperLink and four SuperNodes on a loaded machine)."""
        procs = [self.procs.pop(name) for name in list(self.procs)[::-1]]
        live = [p for p in procs if p.poll() is None]
        for p in live:
            _signal_session(p, signal.SIGTERM)
        deadline = time.monotonic() + 10.0
        for p in live:
            _wait_or_kill(p, max(deadline - time.monotonic(), 0.1))

    def __enter__(self):
        try:
            return self.start()
        except BaseException:
            self.close()
            raise

    def __exit__(self, *exc):
        self.close()


__all__ = ["LocalFederation", "supernode", "free_port", "flower_env"]
