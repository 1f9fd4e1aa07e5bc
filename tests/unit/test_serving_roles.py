"""Flag parsing of the serving roles: instance lists for the controller, the served model name."""

import argparse

import pytest

from aiollm.deploy.roles.common import served_name
from aiollm.deploy.roles.controller import instances


def test_instance_lists_named_or_bare():
    assert instances("p0=tcp://127.0.0.1:7001/prefill0,p1=tcp://127.0.0.1:7002/prefill1") == {
        "p0": "tcp://127.0.0.1:7001/prefill0",
        "p1": "tcp://127.0.0.1:7002/prefill1",
    }
    assert instances("tcp://127.0.0.1:7003/decode0") == {"decode0": "tcp://127.0.0.1:7003/decode0"}
    with pytest.raises(argparse.ArgumentTypeError):
        instances(",")


def test_served_name():
    assert served_name("smollm2") == "smollm2"
    assert served_name("/models/SmolLM2-135M.Q4_1.gguf") == "SmolLM2-135M.Q4_1"
    assert served_name("/models/tiny-llama") == "tiny-llama"
