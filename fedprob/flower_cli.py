"""``fedprob flower ...``: fedprob on Flower's Deployment Engine.

    fedprob flower app CONFIG.toml --out APP_DIR [--run-dir DIR] [--force]
    fedprob flower split CONFIG.toml --out DIR
    fedprob flower certs DIR [--host NAME ...] [--nodes N]
    fedprob flower supernode --superlink HOST:PORT --data FILE.npz (--root-certificates CA --auth-key KEY | --insecure)
    fedprob flower local CONFIG.toml --out DIR [--nodes N]

``local`` does everything on this machine: splits the data set one file per
client, writes the app, starts a SuperLink with TLS and node authentication
and one registered SuperNode per client, runs the app with ``flwr run`` and
stops every process; the run directory is ``DIR/run``.
"""
from __future__ import annotations

import argparse
from pathlib import Path


def add_parser(sub) -> None:
    f = sub.add_parser("flower", help="run on Flower's Deployment Engine (SuperLink, SuperNodes, flwr run)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    fs = f.add_subparsers(dest="flower_cmd", required=True)
    a = fs.add_parser("app", help="write a Flower App directory for a fedprob configuration")
    a.add_argument("config")
    a.add_argument("--out", required=True, help="the app directory")
    a.add_argument("--run-dir", help="where the ServerApp writes its run directory (default runs/<config name>)")
    a.add_argument("--force", action="store_true")
    s = fs.add_parser("split", help="write one .npz per client (X, y, client) from the configuration's data")
    s.add_argument("config")
    s.add_argument("--out", required=True)
    c = fs.add_parser("certs", help="write a CA, the SuperLink's certificate and SuperNode key pairs")
    c.add_argument("dir")
    c.add_argument("--host", action="append", default=[], help="a name or address of the SuperLink (repeatable)")
    c.add_argument("--nodes", type=int, default=0, help="SuperNode key pairs to write")
    n = fs.add_parser("supernode", help="run one SuperNode over one .npz (with fedprob's worker)")
    n.add_argument("--superlink", required=True, help="HOST:PORT of the SuperLink")
    n.add_argument("--data", required=True, help="this node's .npz (X, y[, client])")
    n.add_argument("--root-certificates", help="the federation's ca.crt")
    n.add_argument("--auth-key", help="this node's private key (its public key registered with "
                                      "`flwr supernode register`)")
    n.add_argument("--insecure", action="store_true", help="no TLS (warns; for trying things only)")
    n.add_argument("--port", type=int, help="the SuperNode's local runtime port (default: a free one)")
    loc = fs.add_parser("local", help="a whole federation on this machine: split, app, SuperLink, SuperNodes, run")
    loc.add_argument("config")
    loc.add_argument("--out", required=True, help="working directory (certificates, data, app, logs, run)")
    loc.add_argument("--timeout", type=float, default=1800.0)


def _config(path) -> dict:
    from .flower import spec

    p = Path(path)
    if not p.exists():
        raise ValueError(f"no configuration file {p}")
    return spec.parse(p.read_text())


def split(cfg: dict, out) -> list:
    """One ``client_<k>.npz`` per client of the configuration's partition; their paths."""
    from .flower import nodedata, spec

    fed, _ = spec.federation(cfg)
    return [nodedata.write(Path(out) / f"client_{k}.npz", *fed.client(k), client=k)
            for k in range(fed.num_clients)]


def run_local(cfg: dict, out, timeout: float = 1800.0, echo: bool = True):
    """``fedprob flower local``: the run directory's path."""
    from .flower.appdir import write_app
    from .flower.local import LocalFederation

    out = Path(out)
    paths = split(cfg, out / "data")
    app = write_app(cfg, out / "app", out / "run", force=True)
    with LocalFederation(out / "federation", paths) as fed:
        fed.run(app, timeout=timeout, echo=echo)
    return out / "run"


def main(args) -> int:
    cmd = args.flower_cmd
    if cmd == "app":
        from .flower.appdir import write_app

        run_dir = args.run_dir or Path("runs") / Path(args.config).stem
        out = write_app(_config(args.config), args.out, run_dir, force=args.force)
        print(f"Flower App: {out} (run it with `flwr run {out} <superlink>`; run directory {Path(run_dir).resolve()})")
    elif cmd == "split":
        paths = split(_config(args.config), args.out)
        print(f"wrote {len(paths)} files: {paths[0]} ... {paths[-1]}")
    elif cmd == "certs":
        from .flower.certs import make_certs

        p = make_certs(args.dir, hosts=args.host, nodes=args.nodes)
        print(f"CA {p['ca']}, SuperLink {p['server_cert']} / {p['server_key']}, {args.nodes} node key pairs")
    elif cmd == "supernode":
        from .flower.local import supernode

        if not args.insecure and (args.root_certificates is None):
            raise ValueError("give --root-certificates CA (TLS), or --insecure to run without TLS")
        return supernode(args.superlink, args.data, args.root_certificates, args.auth_key, args.insecure,
                         args.port)
    elif cmd == "local":
        run = run_local(_config(args.config), args.out, args.timeout)
        print(f"run directory: {run}")
    return 0


__all__ = ["add_parser", "main", "split", "run_local"]
