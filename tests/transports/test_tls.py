"""tls:// between nodes: mutual TLS on top of the cluster secret. Nodes with certificates of the cluster's CA talk;
a node whose certificate another CA signed is refused in the TLS handshake, and members are served meanwhile; a
tls:// address without certificates is refused naming what is missing."""

import pytest
import trustme

from aiollm.actors import Node, NodeConfig
from aiollm.actors.echo import EchoActor, Ping, Pong
from aiollm.errors import NodeUnreachable

SECRET = b"tls-test-secret-0123456789abcdef"


def _files(tmp_path, ca: trustme.CA, name: str) -> tuple[tuple[str, str], ...]:
    cert = ca.issue_cert("127.0.0.1", "localhost")
    node_pem, ca_pem = tmp_path / f"{name}.pem", tmp_path / f"{name}-ca.pem"
    cert.private_key_and_cert_chain_pem.write_to_path(str(node_pem))
    ca.cert_pem.write_to_path(str(ca_pem))
    return (("tls.cert", str(node_pem)), ("tls.key", str(node_pem)), ("tls.ca", str(ca_pem)))


async def test_nodes_of_one_ca_talk_and_a_stranger_ca_is_refused(tmp_path, monkeypatch):
    for var in ("AIOLLM_TLS_CERT", "AIOLLM_TLS_KEY", "AIOLLM_TLS_CA"):
        monkeypatch.delenv(var, raising=False)
    cluster_ca, other_ca = trustme.CA(), trustme.CA()
    member = NodeConfig(secret=SECRET, transport_options=_files(tmp_path, cluster_ca, "a"))
    async with Node(member) as server, Node(member) as client:
        await server.start(["tls://127.0.0.1:0"])
        await client.start()
        await server.spawn(EchoActor, "echo")
        assert server.url.startswith("tls://127.0.0.1:")
        assert await client.ref(f"{server.url}/echo").ask(Ping(1), timeout=10) == Pong(1)

        # the right secret does not help a node whose certificate the cluster's CA did not sign
        stranger = NodeConfig(secret=SECRET, transport_options=_files(tmp_path, other_ca, "b"))
        async with Node(stranger) as intruder:
            await intruder.start()
            with pytest.raises(NodeUnreachable):
                await intruder.ref(f"{server.url}/echo").ask(Ping(2), timeout=10)
        assert await client.ref(f"{server.url}/echo").ask(Ping(3), timeout=10) == Pong(3)

    with pytest.raises(ValueError, match=r"tls:// needs tls.cert \(or AIOLLM_TLS_CERT\)"):
        async with Node(NodeConfig(secret=SECRET)) as bare:
            await bare.start(["tls://127.0.0.1:0"])
