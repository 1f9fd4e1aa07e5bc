"""Fixtures for the transport conformance suite: every test runs per transport and per event loop.

`pair` makes a connected (client, server) pair on the transport under test; the UCX parameter is
skipped only when its binding is not installed.
"""

import asyncio
import importlib.util
import os
import uuid
from typing import NamedTuple

import pytest
import trustme
import uvloop

from aiollm.transports import Connection, Listener, TransportConfig, connect, listen

UCX_MISSING = importlib.util.find_spec("ucxx") is None
SCHEMES = [
    "inproc",
    "tcp",
    "tls",
    pytest.param(
        "ucx",
        marks=[
            pytest.mark.ucx,
            pytest.mark.skipif(UCX_MISSING, reason="UCX binding absent: pip install 'aiollm[ucx]'"),
        ],
    ),
]
# Seconds any single step of a test may take before it counts as a hang.
STEP = 10.0


@pytest.fixture(scope="session", autouse=True)
def tls_certificates(tmp_path_factory):
    """A cluster CA and one node certificate for 127.0.0.1, given to tls:// through its environment variables
    (the suite's configs carry no options, as in production where the variables hold the paths)."""
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1", "localhost")
    directory = tmp_path_factory.mktemp("tls")
    paths = {"AIOLLM_TLS_CA": directory / "ca.pem", "AIOLLM_TLS_CERT": directory / "node.pem"}
    ca.cert_pem.write_to_path(str(paths["AIOLLM_TLS_CA"]))
    cert.private_key_and_cert_chain_pem.write_to_path(str(paths["AIOLLM_TLS_CERT"]))
    paths["AIOLLM_TLS_KEY"] = paths["AIOLLM_TLS_CERT"]
    saved = {key: os.environ.get(key) for key in paths}
    os.environ.update({key: str(path) for key, path in paths.items()})
    yield ca
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def pytest_asyncio_loop_factories(config, item):
    """Run every transport test on both the stdlib loop and uvloop (the transports must work on both)."""
    return {"asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}


def listen_url(scheme: str) -> str:
    """An address to listen on: a fresh name for inproc, port 0 on loopback otherwise."""
    if scheme == "inproc":
        return f"inproc://test-{uuid.uuid4().hex[:8]}"
    return f"{scheme}://127.0.0.1:0"


class Pair(NamedTuple):
    """A connected pair and its listener; later connections to the listener arrive on `accepted`."""

    client: Connection
    server: Connection
    listener: Listener
    accepted: asyncio.Queue


@pytest.fixture(params=SCHEMES)
def scheme(request) -> str:
    return request.param


@pytest.fixture
async def pair(scheme):
    """`await pair(server_config=None, client_config=None)` -> a `Pair`; everything is closed after the test."""
    opened = []

    async def make(server_config: TransportConfig | None = None, client_config: TransportConfig | None = None):
        accepted: asyncio.Queue = asyncio.Queue()
        listener = await listen(listen_url(scheme), accepted.put, server_config)
        opened.append(listener)
        client = await connect(listener.address, client_config)
        opened.append(client)
        server = await asyncio.wait_for(accepted.get(), STEP)
        opened.append(server)
        return Pair(client, server, listener, accepted)

    yield make
    for item in reversed(opened):
        await item.close()
