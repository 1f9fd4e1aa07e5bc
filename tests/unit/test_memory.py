"""A model's size from its config (aiollm.model.size) against real parameter counts, and the memory check that
refuses, before anything starts, a spec whose processes cannot hold their weights and KV (aiollm.deploy.memory)."""

import argparse
import json
import math

import numpy as np
import pytest
import torch

from aiollm.cli import node as node_cli
from aiollm.cli import serve as serve_cli
from aiollm.cli.plan import main as plan_main
from aiollm.deploy.memory import check_memory, processes
from aiollm.deploy.spec import ClusterSpec, SpecError
from aiollm.kv.pool import KVConfig
from aiollm.model.config import ModelConfig
from aiollm.model.gguf_file import GGUFFile
from aiollm.model.loader import load, load_config, resolve
from aiollm.model.size import held_params, kv_bytes_per_token, param_count, weights_bytes
from aiollm.model.weights import assemble, expected_shapes
from aiollm.testing.tiny_families import FAMILIES, write_family_dir

# a small model whose sizes are easy to state: weights 4 * held_params bytes, one fp32 block 2*2*16*16*4*2 = 16 KiB
SMALL = ModelConfig(n_layers=2, hidden=64, n_heads=4, n_kv_heads=2, head_dim=16, ffn=128, vocab=1000)


@pytest.fixture(scope="module")
def smollm2_file():
    return GGUFFile(resolve("smollm2"))


@pytest.fixture(scope="module")
def smollm2(smollm2_file):
    return smollm2_file.config


def _held(weights) -> int:
    """Elements of every tensor a loaded model holds (packed matrices by their logical shape)."""
    tensors = [weights.embed, weights.norm, weights.lm_head]
    for layer in weights.layers:
        tensors += [getattr(layer, f) for f in ("attn_norm", "qkv", "o", "mlp_norm", "gate_up", "down")]
        tensors += [t for t in (layer.qkv_bias, layer.q_norm, layer.k_norm) if t is not None]
    return sum(math.prod(t.shape) for t in tensors)


class _Shapes:
    """A tensor source of the config's shapes on the meta device: what `assemble` builds, without data."""

    def __init__(self, config):
        self.path, self.shapes = "shapes", expected_shapes(config)

    def names(self):
        return set(self.shapes)

    def get(self, name):
        return torch.empty(self.shapes[name], device="meta")


def test_smollm2_parameters_are_its_files_tensors_and_a_loaded_process_holds_the_tied_copy(smollm2_file, smollm2):
    in_file = sum(int(np.prod(t.shape)) for t in smollm2_file._reader.tensors)
    assert param_count(smollm2) == in_file == smollm2.n_params
    assert smollm2.tie_embeddings
    weights = assemble(smollm2, _Shapes(smollm2), torch.float32, "meta")
    assert _held(weights) == held_params(smollm2) == in_file + smollm2.vocab * smollm2.hidden
    assert weights_bytes(smollm2, "fp32") == 2 * weights_bytes(smollm2, "bf16") == 4 * held_params(smollm2)


@pytest.mark.parametrize("family, extra", [*((f, {}) for f in FAMILIES), ("llama3", {"tie_word_embeddings": True})])
def test_each_tiny_family_has_the_parameters_transformers_counts(tmp_path, family, extra):
    model = write_family_dir(tmp_path, family, **extra)
    config = load_config(tmp_path)
    assert param_count(config) == sum(p.numel() for p in model.parameters())
    loaded = load(tmp_path, dtype="bf16")
    assert _held(loaded.weights) * 2 == weights_bytes(config, "bf16")


def test_kv_bytes_per_token_is_a_blocks_bytes_over_its_tokens():
    block = KVConfig.for_model(SMALL, 1, 16, "int8").bytes_per_block
    assert kv_bytes_per_token(SMALL, "int8") == block / 16
    assert kv_bytes_per_token(SMALL, "fp32") == 2 * 2 * 2 * 16 * 4


def test_a_decode_memory_that_cannot_hold_weights_and_kv_is_refused_with_the_numbers(smollm2):
    spec = ClusterSpec().override({"decode.memory": "2GiB", "decode.kv_blocks": 4096})
    with pytest.raises(SpecError) as refused:
        check_memory(spec, config=smollm2)
    assert str(refused.value) == (
        "decode.memory: 2.0 GiB cannot hold the weights (621.1 MiB, fp32) and 4096 KV blocks of 16 tokens "
        "(2.8 GiB, fp32); 2029 KV blocks fit beside the weights"
    )
    check_memory(spec.override({"decode.kv_blocks": 2029}), config=smollm2)
    with pytest.raises(SpecError, match=r"^prefill.memory: 600.0 MiB cannot hold the weights \(310.6 MiB, bf16\)"):
        check_memory(spec.override({"prefill.memory": "600MiB", "model.dtype": "bf16"}), config=smollm2)


def test_a_spec_that_fits_passes_and_no_budget_reads_no_model():
    spec = ClusterSpec().override({"prefill.memory": "1GiB", "decode.memory": "1MiB", "decode.kv_blocks": 16})
    check_memory(spec, config=SMALL)
    check_memory(ClusterSpec().override({"model.name": "/nowhere/model.gguf"}))  # nothing set: nothing read
    with pytest.raises(SpecError, match="model.name: model not found"):
        check_memory(ClusterSpec().override({"model.name": "/nowhere/model.gguf", "decode.memory": "1GiB"}))
    with pytest.raises(SpecError, match="decode.memory: memory size 'lots'"):
        ClusterSpec.from_dict({"decode": {"memory": "lots"}})


def test_r_workers_never_count_weights_and_an_offloaded_decode_holds_no_kv():
    weights = weights_bytes(SMALL, "fp32")
    spec = ClusterSpec().override(
        {"decode.r_workers": 2, "decode.memory": str(weights), "decode.kv_blocks": 10**6, "r_worker.kv_memory": "16KiB"}
    )
    check_memory(spec, config=SMALL)
    by_field = {p.field: p for p in processes(spec, SMALL)}
    assert by_field["r_worker.kv_memory"].weights == 0 and by_field["decode.memory"].kv_blocks == 0
    assert by_field["prefill.memory"].weights == by_field["decode.memory"].weights == weights
    with pytest.raises(SpecError, match=r"^r_worker.kv_memory: 1.0 KiB cannot hold one KV block of 16 tokens"):
        check_memory(spec.override({"r_worker.kv_memory": "1KiB"}), config=SMALL)
    with pytest.raises(SpecError, match=r"^decode.memory: .* its KV is on the R-workers"):
        check_memory(spec.override({"decode.memory": str(weights - 1)}), config=SMALL)
    s_worker = processes(spec.override({"s_worker.staging_tokens": 33}), SMALL, ["s_worker"])[0]
    assert (s_worker.weights, s_worker.kv_blocks) == (weights, 3)


def test_serve_refuses_a_spec_that_does_not_fit_before_starting_anything(monkeypatch, capsys):
    import aiollm.deploy.local as local

    def started(*_):
        raise AssertionError("nothing may start")

    monkeypatch.setattr(local, "run", started)
    parser = argparse.ArgumentParser()
    serve_cli.add_arguments(parser)
    assert serve_cli.run(parser.parse_args(["--decode-memory", "100MiB"])) == 2
    assert "decode.memory: 100.0 MiB cannot hold the weights (621.1 MiB, fp32)" in capsys.readouterr().err
    assert serve_cli.run(parser.parse_args(["--colocated", "--decode-memory", "1GiB", "--ray"])) == 2
    assert "decode.memory: 1.0 GiB cannot hold" in capsys.readouterr().err


def test_the_per_role_cli_refuses_a_role_that_does_not_fit(tmp_path, capsys):
    secret = tmp_path / "secret"
    secret.write_text("0123456789abcdef0123")
    secret.chmod(0o600)
    with pytest.raises(SystemExit) as exited:
        node_cli.parse(["--role", "prefill", "--secret-file", str(secret), "--memory", "200MiB"])
    assert exited.value.code == 2
    assert "prefill.memory: 200.0 MiB cannot hold the weights (621.1 MiB, fp32)" in capsys.readouterr().err
    urls = "tcp://127.0.0.1:7001"
    launch = node_cli.parse(
        ["--role", "decode", "--secret-file", str(secret), "--memory", "700MiB", "--r-workers", urls]
    )
    assert launch.spec.decode.memory == "700MiB"


def test_a_local_profile_records_the_models_size(tmp_path, smollm2):
    from aiollm.calibrate.profile import model_size
    from aiollm.planner.profiles import LOCAL_FORMAT, load_local

    size = model_size(smollm2, "bf16", "int8")
    assert size == {
        "weights_bytes": weights_bytes(smollm2, "bf16"),
        "kv_bytes_per_token": kv_bytes_per_token(smollm2, "int8"),
    }
    entry = {"prefill": [1e-3, 1e-5, 0.0], "decode": [1e-3, 1e-4, 1e-8], **size}
    path = tmp_path / "profile.json"
    path.write_text(json.dumps({"format": LOCAL_FORMAT, "hardware": "cpu", "models": {"smollm2": entry}}))
    latency = load_local(path)["smollm2"]
    assert (latency.weights_bytes, latency.kv_bytes_per_token) == (size["weights_bytes"], size["kv_bytes_per_token"])


def test_an_emitted_plan_carries_the_memory_and_one_that_cannot_fit_is_refused(tmp_path, capsys):
    emit = tmp_path / "cluster.toml"
    argv = ["distserve", "--model", "opt-13b", "--cluster", "1x4xA100-80G", "--ttft", "0.4", "--tpot", "0.1"]
    argv += ["--requests", "60", "--workers", "1", "--emit", str(emit), "--base"]
    base = tmp_path / "base.toml"
    base.write_text("[prefill]\nkv_blocks = 64\n[decode]\nkv_blocks = 256\n")
    assert plan_main([*argv, str(base), "--memory-per-process", "1GiB"]) in (0, 1)
    spec = ClusterSpec.from_toml(emit)
    assert spec.prefill.memory == spec.decode.memory == "1GiB"
    emit.unlink()
    assert plan_main([*argv, str(base), "--memory-per-process", "700MiB", "--rel-tol", "0.2"]) == 2
    err = capsys.readouterr().err
    assert "--memory-per-process 700MiB: the planned instances do not fit: decode.memory: 700.0 MiB" in err
    assert not emit.exists()
