"""Fixtures of the integration tests: tiny random-weight Llamas written by transformers."""

import pytest

from aiollm.model.loader import load
from aiollm.testing.tiny_llama import write_hf_dir


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    """A tiny random-weight Llama (HF directory), loaded once per test run."""
    directory = tmp_path_factory.mktemp("tiny-llama")
    write_hf_dir(directory)
    return load(str(directory))


@pytest.fixture(scope="module")
def tiny_fd(tmp_path_factory):
    """A tiny Llama with larger weights (init_std 0.2) for the FastDecode tests: the loaded model and its
    directory, which R-worker processes read their KV shape from."""
    directory = tmp_path_factory.mktemp("tiny_fastdecode")
    write_hf_dir(directory, init_std=0.2)
    return load(directory), directory
