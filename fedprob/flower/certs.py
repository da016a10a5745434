"""TLS certificates and SuperNode keys for a Flower federation, with the ``cryptography`` package.

:func:`make_certs` writes, into one directory:

* ``ca.crt`` / ``ca.key``: a self-signed certificate authority (the root
  certificate every SuperNode and ``flwr`` pass as ``root-certificates``);
* ``server.pem`` / ``server.key``: the SuperLink's certificate, signed by the
  CA, valid for ``localhost``, ``127.0.0.1`` and the ``hosts`` given (the
  names and addresses SuperNodes and users connect to);
* with ``nodes=n``: ``node_<i>`` / ``node_<i>.pub`` (i = 0..n-1), one
  SuperNode's private key (PEM) and public key (OpenSSH), for
  ``flower-supernode --auth-supernode-private-key`` and ``flwr supernode
  register`` (SuperNode authentication: the SuperLink refuses nodes whose
  public key was not registered).

Keys are elliptic-curve (SECP384R1), as Flower's node authentication expects.
Private keys are written with mode 0600. Certificates are valid for
``days`` days (default 365).
"""
from __future__ import annotations

import datetime
import ipaddress
import os
from pathlib import Path
from typing import Sequence


def _write(path: Path, data: bytes, private: bool = False) -> None:
    path.write_bytes(data)
    if private:
        os.chmod(path, 0o600)


def _key():
    from cryptography.hazmat.primitives.asymmetric import ec

    return ec.generate_private_key(ec.SECP384R1())


def _pem_key(key) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _san(hosts: Sequence[str]):
    from cryptography import x509

    names = []
    for h in dict.fromkeys(["localhost", "127.0.0.1", "::1", *hosts]):
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            names.append(x509.DNSName(h))
    return x509.SubjectAlternativeName(names)


def make_certs(out, hosts: Sequence[str] = (), nodes: int = 0, days: int = 365) -> dict:
    """Write the CA, the SuperLink's certificate and ``nodes`` SuperNode key pairs into ``out``;
    returns the paths by name (``ca``, ``server_cert``, ``server_key``, ``node_keys``, ``node_pubs``).
    An existing ``out/ca.crt`` is a FileExistsError (certificates are not overwritten silently)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.x509.oid import NameOID

    if isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 0:
        raise ValueError(f"nodes must be a non-negative integer, got {nodes!r}")
    out = Path(out)
    if (out / "ca.crt").exists():
        raise FileExistsError(f"{out / 'ca.crt'} exists; choose an empty directory")
    out.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc)
    until = now + datetime.timedelta(days=int(days))

    ca_key = _key()
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "fedprob federation CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(now).not_valid_after(until)
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .sign(ca_key, hashes.SHA256()))
    srv_key = _key()
    srv = (x509.CertificateBuilder()
           .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "fedprob superlink")]))
           .issuer_name(ca_name).public_key(srv_key.public_key()).serial_number(x509.random_serial_number())
           .not_valid_before(now).not_valid_after(until).add_extension(_san(hosts), critical=False)
           .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
           .sign(ca_key, hashes.SHA256()))
    paths = {"ca": out / "ca.crt", "ca_key": out / "ca.key", "server_cert": out / "server.pem",
             "server_key": out / "server.key", "node_keys": [], "node_pubs": []}
    _write(paths["ca"], ca.public_bytes(serialization.Encoding.PEM))
    _write(paths["ca_key"], _pem_key(ca_key), private=True)
    _write(paths["server_cert"], srv.public_bytes(serialization.Encoding.PEM))
    _write(paths["server_key"], _pem_key(srv_key), private=True)
    for i in range(nodes):
        priv, pub = node_keypair(out / f"node_{i}")
        paths["node_keys"].append(priv)
        paths["node_pubs"].append(pub)
    return paths


def node_keypair(path) -> tuple:
    """Write one SuperNode's key pair: ``path`` (private, OpenSSH PEM) and ``path.pub`` (public, OpenSSH);
    returns both paths."""
    from cryptography.hazmat.primitives import serialization

    path = Path(path)
    key = _key()
    pub = path.with_name(path.name + ".pub")
    _write(path, key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
                                   serialization.NoEncryption()), private=True)
    _write(pub, key.public_key().public_bytes(serialization.Encoding.OpenSSH,
                                             serialization.PublicFormat.OpenSSH) + b"\n")
    return path, pub


__all__ = ["make_certs", "node_keypair"]
