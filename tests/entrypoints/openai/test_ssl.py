"""HTTPS with a client-certificate requirement (--ssl-keyfile/--ssl-certfile, and the seeds'
--ssl-ca-certs/--ssl-cert-reqs): a client presenting a certificate from the CA is served; one
without is refused at the TLS handshake."""

from __future__ import annotations

import ssl
import subprocess

import httpx
import pytest
from openai_server import RunningServer, server_args

from jllm.entrypoints.openai.api_server import build_app, build_engine, ssl_options


def openssl(*args, cwd):
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    """A CA, a server certificate for 127.0.0.1 and a client certificate, both signed by it."""
    d = tmp_path_factory.mktemp("certs")
    openssl(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-days",
        "1",
        "-subj",
        "/CN=test-ca",
        "-keyout",
        "ca.key",
        "-out",
        "ca.pem",
        cwd=d,
    )
    for name in ("server", "client"):
        openssl(
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-subj",
            f"/CN={name}",
            "-keyout",
            f"{name}.key",
            "-out",
            f"{name}.csr",
            cwd=d,
        )
        (d / f"{name}.ext").write_text("subjectAltName=IP:127.0.0.1\n")
        openssl(
            "x509",
            "-req",
            "-in",
            f"{name}.csr",
            "-CA",
            "ca.pem",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-days",
            "1",
            "-extfile",
            f"{name}.ext",
            "-out",
            f"{name}.pem",
            cwd=d,
        )
    return d


def test_https_with_a_required_client_certificate(llama_dir, certs):
    args = server_args(
        llama_dir,
        "--ssl-keyfile",
        str(certs / "server.key"),
        "--ssl-certfile",
        str(certs / "server.pem"),
        "--ssl-ca-certs",
        str(certs / "ca.pem"),
        "--ssl-cert-reqs",
        str(int(ssl.CERT_REQUIRED)),
    )
    engine, metrics = build_engine(args)
    running = RunningServer(build_app(args, engine, metrics), engine, **ssl_options(args))
    url = f"https://127.0.0.1:{running.port}/health"
    try:
        context = ssl.create_default_context(cafile=str(certs / "ca.pem"))
        context.load_cert_chain(str(certs / "client.pem"), str(certs / "client.key"))
        assert httpx.get(url, verify=context).status_code == 200
        bare = ssl.create_default_context(cafile=str(certs / "ca.pem"))
        with pytest.raises((httpx.ConnectError, httpx.ReadError, httpx.RemoteProtocolError)):
            httpx.get(url, verify=bare)
    finally:
        running.stop()
        engine.shutdown()
