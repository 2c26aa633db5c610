"""Certificates and kubeconfigs of the test control plane (openssl, loopback names)."""

from __future__ import annotations

from pathlib import Path

import yaml

from slimspec_testbed.tools import run_checked


def _openssl(*args: str, cwd: Path) -> None:
    run_checked(["openssl", *args], cwd=cwd, timeout=60)


def make_pki(pki: Path, server_ips: tuple[str, ...] = ()) -> None:
    """CA, API serving cert (127.0.0.1/localhost, and `server_ips`: addresses other
    nodes reach it at) and service-account key pair."""
    pki.mkdir(parents=True, exist_ok=True)
    _openssl("ecparam", "-name", "prime256v1", "-genkey", "-noout", "-out", "ca.key", cwd=pki)
    _openssl(
        "req", "-x509", "-new", "-key", "ca.key", "-days", "30", "-subj",
        "/CN=slimspec-testbed-ca", "-out", "ca.crt", cwd=pki,
    )  # fmt: skip
    _openssl("ecparam", "-name", "prime256v1", "-genkey", "-noout", "-out", "server.key", cwd=pki)
    _openssl(
        "req", "-new", "-key", "server.key", "-subj", "/CN=kube-apiserver", "-out",
        "server.csr", cwd=pki,
    )  # fmt: skip
    extra = "".join(f",IP:{ip}" for ip in server_ips)
    (pki / "server.ext").write_text(
        "subjectAltName=IP:127.0.0.1,DNS:localhost,DNS:kubernetes,"
        f"DNS:kubernetes.default,DNS:kubernetes.default.svc,IP:10.0.0.1{extra}\n"
        "extendedKeyUsage=serverAuth\n"
    )
    _openssl(
        "x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
        "-CAcreateserial", "-days", "30", "-extfile", "server.ext", "-out", "server.crt",
        cwd=pki,
    )  # fmt: skip
    _openssl("genrsa", "-out", "sa.key", "2048", cwd=pki)
    _openssl("rsa", "-in", "sa.key", "-pubout", "-out", "sa.pub", cwd=pki)


FRONT_PROXY_CLIENT = "front-proxy-client"


def make_front_proxy_pki(pki: Path) -> None:
    """The aggregation layer's CA and the client cert the API server presents to an
    extension API server (KEDA's metrics server), as kubeadm makes them: a CA of its
    own, so an extension server trusts the identity headers only from the API server."""
    _openssl(
        "ecparam", "-name", "prime256v1", "-genkey", "-noout", "-out", "front-proxy-ca.key",
        cwd=pki,
    )  # fmt: skip
    _openssl(
        "req", "-x509", "-new", "-key", "front-proxy-ca.key", "-days", "30", "-subj",
        "/CN=slimspec-front-proxy-ca", "-out", "front-proxy-ca.crt", cwd=pki,
    )  # fmt: skip
    _openssl(
        "ecparam", "-name", "prime256v1", "-genkey", "-noout", "-out", "front-proxy-client.key",
        cwd=pki,
    )  # fmt: skip
    _openssl(
        "req", "-new", "-key", "front-proxy-client.key", "-subj", f"/CN={FRONT_PROXY_CLIENT}",
        "-out", "front-proxy-client.csr", cwd=pki,
    )  # fmt: skip
    (pki / "front-proxy-client.ext").write_text("extendedKeyUsage=clientAuth\n")
    _openssl(
        "x509", "-req", "-in", "front-proxy-client.csr", "-CA", "front-proxy-ca.crt",
        "-CAkey", "front-proxy-ca.key", "-CAcreateserial", "-days", "30",
        "-extfile", "front-proxy-client.ext", "-out", "front-proxy-client.crt", cwd=pki,
    )  # fmt: skip


def write_kubeconfig(path: Path, server: str, ca_file: Path, token: str, user: str) -> Path:
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": "slimspec",
                "cluster": {"server": server, "certificate-authority": str(ca_file)},
            }
        ],
        "users": [{"name": user, "user": {"token": token}}],
        "contexts": [{"name": user, "context": {"cluster": "slimspec", "user": user}}],
        "current-context": user,
    }
    path.write_text(yaml.safe_dump(config))
    path.chmod(0o600)
    return path
