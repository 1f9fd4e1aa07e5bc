import pytest

from aiollm.errors import AiollmError, RemoteError
from aiollm.transports import TransportConfig, parse_address


def test_parse_tcp_address_with_actor_path():
    addr = parse_address("tcp://127.0.0.1:7001/echo")
    assert (addr.scheme, addr.host, addr.port, addr.path) == ("tcp", "127.0.0.1", 7001, "echo")
    assert addr.node_url == "tcp://127.0.0.1:7001"


def test_parse_inproc_address():
    addr = parse_address("inproc://node0/actor")
    assert (addr.scheme, addr.host, addr.path) == ("inproc", "node0", "actor")
    assert addr.node_url == "inproc://node0"


@pytest.mark.parametrize(
    "url, fragment",
    [
        ("http://127.0.0.1:80", "unknown scheme"),
        ("tcp://127.0.0.1", "expected tcp://host:port"),
        ("tcp://127.0.0.1:notaport", "bad port"),
        ("inproc://", "need a name"),
    ],
)
def test_bad_addresses_name_the_problem(url, fragment):
    with pytest.raises(ValueError, match=fragment):
        parse_address(url)


def test_transport_config_validates_fields():
    with pytest.raises(ValueError, match="max_frame_bytes"):
        TransportConfig(max_frame_bytes=0)


def test_remote_error_carries_type_and_message():
    err = RemoteError("KeyError", "'x'", "Traceback ...")
    assert isinstance(err, AiollmError)
    assert str(err) == "KeyError: 'x'"
    assert err.traceback_text == "Traceback ..."
