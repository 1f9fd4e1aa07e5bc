"""TLS transport (`tls://host:port`): the tcp transport's frames inside mutually authenticated TLS.

For clusters whose nodes talk across networks they do not trust. Both sides present a certificate signed by the
cluster's CA and check the other's (mutual TLS): a peer without one is refused in the TLS handshake, before the
node's own secret handshake even starts. Everything else (framing, limits, flow control, push mode) is the tcp
transport's.

Options (`TransportConfig.options`, else the environment, so that node processes can be given them without
flags): `tls.cert` (this node's certificate chain, PEM; `AIOLLM_TLS_CERT`), `tls.key` (its private key;
`AIOLLM_TLS_KEY`), `tls.ca` (the CA that signs the cluster's certificates; `AIOLLM_TLS_CA`), and
`tls.check_hostname` (1: the peer's certificate must name the host connected to; 0: any certificate of the
cluster's CA will do, for addresses that change).
"""

from __future__ import annotations

import os
import ssl

from aiollm.transports.base import TransportConfig
from aiollm.transports.framing import options_for
from aiollm.transports.tcp import TcpTransport

DEFAULT_OPTIONS: dict[str, int | str] = {"tls.cert": "", "tls.key": "", "tls.ca": "", "tls.check_hostname": 1}
ENVIRONMENT = {"tls.cert": "AIOLLM_TLS_CERT", "tls.key": "AIOLLM_TLS_KEY", "tls.ca": "AIOLLM_TLS_CA"}


def _files(config: TransportConfig) -> dict[str, str]:
    """The certificate, key and CA paths; ValueError naming any that is missing."""
    opts = options_for(config, "tls", DEFAULT_OPTIONS)
    files = {key: str(opts[key]) or os.environ.get(env, "") for key, env in ENVIRONMENT.items()}
    missing = [f"{key} (or {ENVIRONMENT[key]})" for key, path in files.items() if not path]
    if missing:
        raise ValueError(f"tls:// needs {', '.join(missing)}")
    return files


def _context(purpose: ssl.Purpose, config: TransportConfig) -> ssl.SSLContext:
    files = _files(config)
    context = ssl.create_default_context(purpose, cafile=files["tls.ca"])
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(files["tls.cert"], files["tls.key"])
    return context


class TlsTransport(TcpTransport):
    """The tcp transport with mutual TLS: both sides present and verify certificates of the cluster's CA."""

    scheme = "tls"

    def server_ssl(self, config: TransportConfig) -> ssl.SSLContext:
        context = _context(ssl.Purpose.CLIENT_AUTH, config)
        context.verify_mode = ssl.CERT_REQUIRED  # mutual: a client without a certificate of the CA is refused
        return context

    def client_ssl(self, config: TransportConfig) -> ssl.SSLContext:
        context = _context(ssl.Purpose.SERVER_AUTH, config)
        context.check_hostname = bool(int(options_for(config, "tls", DEFAULT_OPTIONS)["tls.check_hostname"]))
        return context


TRANSPORT = TlsTransport()
