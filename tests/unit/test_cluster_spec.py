"""The cluster spec: TOML and Python build the same validated object, a bad field is refused by name before
anything starts, and every entry point (serve's flags, the per-role CLI, Graph) configures roles through it."""

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from aiollm.cli import node as node_cli
from aiollm.cli import serve as serve_cli
from aiollm.deploy.graph import Graph
from aiollm.deploy.roles import ROLES, Wiring, parse_role_args
from aiollm.deploy.roles.controller import controller_config
from aiollm.deploy.roles.decode import decode_config
from aiollm.deploy.spec import ClusterSpec, DecodeSpec, KVSpec, PrefillSpec, SpecError
from aiollm.kv.pool import DEFAULT_KV_DTYPE

EXAMPLE = Path(__file__).parents[2] / "examples" / "cluster.toml"


def test_the_example_spec_loads_and_round_trips_through_toml(tmp_path):
    spec = ClusterSpec.from_toml(EXAMPLE)
    assert (spec.prefill.count, spec.decode.count, spec.model.name) == (1, 1, "smollm2")
    path = tmp_path / "again.toml"
    path.write_text(spec.to_toml())
    assert ClusterSpec.from_toml(path) == spec
    built = ClusterSpec(decode=DecodeSpec(count=2, r_workers=3), kv=KVSpec(dtype="fp16"))
    assert ClusterSpec.from_dict(built.to_dict()) == built


def test_one_kv_default_for_every_role():
    spec = ClusterSpec()
    assert spec.kv.dtype == DEFAULT_KV_DTYPE
    assert decode_config(spec).kv_dtype == DEFAULT_KV_DTYPE
    r_spec, _ = parse_role_args("r-worker", [])
    assert r_spec.kv.dtype == DEFAULT_KV_DTYPE


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"prefill": {"count": 0}}, "prefill.count: must be >= 1, got 0"),
        ({"prefill": {"count": "two"}}, "prefill.count: expected `int`, got `str`"),
        ({"decode": {"max_runing": 8}}, "decode.max_runing: unknown field"),
        ({"decoder": {"count": 1}}, "decoder: unknown section or field"),
        ({"kv": {"dtype": "fp8"}}, "kv.dtype: must be one of fp32, fp16, int8, int4, got 'fp8'"),
        ({"model": {"dtype": "fp16"}}, "model.dtype: must be one of fp32, bf16"),
        ({"r_worker": {"kv_memory": "lots"}}, "r_worker.kv_memory: memory size 'lots'"),
        ({"frontend": {"port": 70000}}, "frontend.port: must be in 0..65535"),
        ({"frontend": {"listen": "http://127.0.0.1:1"}}, "frontend.listen: address 'http://127.0.0.1:1'"),
        ({"controller": {"advertise": "tcp://h:1/controller"}}, "controller.advertise: 'tcp://h:1/controller'"),
        ({"prefill": {"count": 2, "listen": "tcp://127.0.0.1:7000"}}, "prefill.listen: port 7000 fixed for 2"),
        ({"node": {"heartbeat_timeout": 0.5}}, "node.heartbeat_timeout: must exceed heartbeat_interval"),
        ({"log_level": "LOUD"}, "log_level: must be one of"),
    ],
)
def test_a_bad_field_is_refused_naming_it(data, message):
    with pytest.raises(SpecError) as err:
        ClusterSpec.from_dict(data)
    assert str(err.value).startswith(message), str(err.value)


def test_a_bad_file_names_the_file_and_the_field(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("[decode]\nr_workers = -1\n")
    with pytest.raises(SpecError, match=r"c\.toml: decode\.r_workers: must be >= 0"):
        ClusterSpec.from_toml(path)
    path.write_text("[decode\n")
    with pytest.raises(SpecError, match="not valid TOML"):
        ClusterSpec.from_toml(path)
    with pytest.raises(SpecError, match="cannot read the cluster spec"):
        ClusterSpec.from_toml(tmp_path / "missing.toml")


def test_python_construction_validates_too_and_override_names_unknown_fields():
    with pytest.raises(ValueError, match="count: must be >= 1"):
        PrefillSpec(count=0)
    spec = ClusterSpec().override({"decode.count": 3, "kv.dtype": "fp16", "prefill.threads": None})
    assert (spec.decode.count, spec.kv.dtype, spec.prefill.threads) == (3, "fp16", 1)
    with pytest.raises(SpecError, match="decode.counts: unknown field"):
        ClusterSpec().override({"decode.counts": 3})
    with pytest.raises(SpecError, match="decode.count: must be >= 1"):
        ClusterSpec().override({"decode.count": 0})


def _serve_args(argv):
    parser = argparse.ArgumentParser()
    serve_cli.add_arguments(parser)
    return parser.parse_args(argv)


def test_serve_flags_build_the_spec_on_top_of_the_config():
    spec = serve_cli.build_spec(_serve_args(["--config", str(EXAMPLE), "--decode", "2", "--threads", "2"]))
    assert spec.decode.count == 2 and spec.prefill.count == 1
    assert spec.prefill.threads == spec.decode.threads == spec.r_worker.threads == 2
    spec = serve_cli.build_spec(_serve_args(["--colocated", "--kv-dtype", "int8", "--r-kv-memory", "2GiB"]))
    assert spec.colocated and spec.kv.dtype == "int8" and spec.r_worker.kv_memory_bytes == 2 * 2**30
    with pytest.raises(SpecError, match="decode.count: must be >= 1"):
        serve_cli.build_spec(_serve_args(["--decode", "0"]))


def test_role_flags_override_the_config_and_wiring_round_trips(tmp_path):
    config = tmp_path / "c.toml"
    config.write_text('[kv]\ndtype = "fp16"\n[decode]\nmax_running = 16\nkv_blocks = 99\n')
    wiring = Wiring(actor="decode3", r_workers=("tcp://127.0.0.1:1/r-worker",), step_log="x.jsonl")
    spec, back = parse_role_args("decode", [*wiring.to_args(), "--kv-blocks", "64"], ClusterSpec.from_toml(config))
    assert back == wiring
    assert (spec.kv.dtype, spec.decode.max_running, spec.decode.kv_blocks) == ("fp16", 16, 64)
    wiring = Wiring(prefill={"p0": "tcp://h:1/p0"}, decode={"d0": "tcp://h:2/d0", "d1": "tcp://h:3/d1"})
    spec, back = parse_role_args("controller", [*wiring.to_args(), "--max-waiting", "7"])
    assert back.prefill == wiring.prefill and back.decode == wiring.decode
    assert controller_config(spec).max_waiting == 7
    with pytest.raises(ValueError, match="unknown role 'decoder'"):
        parse_role_args("decoder", [])
    with pytest.raises(SpecError, match="decode.max_running: must be >= 1"):
        parse_role_args("decode", ["--max-running", "0"])


def test_node_cli_reads_the_spec_and_its_role_section(tmp_path):
    secret = tmp_path / "secret"
    secret.write_bytes(b"s" * 32)
    secret.chmod(0o600)
    config = tmp_path / "c.toml"
    config.write_text(
        '[prefill]\nlisten = "tcp://127.0.0.1:0"\nadvertise = "tcp://host-a:0"\n[node]\nmailbox_size = 9\n'
    )
    base = ["--secret-file", str(secret), "--config", str(config)]
    launch = node_cli.parse(["--role", "prefill", *base, "--kv-blocks", "12", "--actor", "prefill4"])
    assert launch.spec.prefill.kv_blocks == 12 and launch.wiring.actor == "prefill4"
    assert launch.listen == ("tcp://127.0.0.1:0",) and launch.advertise == "tcp://host-a:0"
    assert launch.node_config.mailbox_size == 9
    launch = node_cli.parse(["--role", "prefill", *base, "--listen", "tcp://127.0.0.1:5", "--advertise", ""])
    assert launch.listen == ("tcp://127.0.0.1:5",) and launch.advertise == ""


def _node(*args):
    return subprocess.run([sys.executable, "-m", "aiollm.node", *args], capture_output=True, text=True, timeout=60)


def test_each_role_help_lists_its_own_options_and_a_bad_spec_exits_2(tmp_path):
    decode_help = _node("--role", "decode", "--help").stdout
    assert "--max-running" in decode_help and "--r-workers" in decode_help and "--kv-dtype" in decode_help
    assert "--max-running" not in _node("--role", "r-worker", "--help").stdout
    assert all(role in _node("--help").stdout for role in ROLES)
    secret = tmp_path / "secret"
    secret.write_bytes(b"s" * 32)
    secret.chmod(0o600)
    bad = tmp_path / "bad.toml"
    bad.write_text("[decode]\nmax_running = 0\n")
    out = _node("--role", "decode", "--secret-file", str(secret), "--config", str(bad))
    assert out.returncode == 2 and "decode.max_running: must be >= 1" in out.stderr


async def test_graph_starts_a_role_from_a_typed_spec_in_process():
    from aiollm.serving.fastdecode.messages import GetRLoad

    async with Graph() as graph:
        spec = ClusterSpec().override({"r_worker.kv_memory": "8MiB", "kv.dtype": "fp16", "kv.block_size": 32})
        handle = await graph.start_node("r-worker", spec=spec)
        load = await graph.ref(handle.actors["r-worker"]).ask(GetRLoad())
        assert (load.dtype, load.block_size) == ("fp16", 32)
        assert handle.node.actors["r-worker"].actor.kv_memory == 8 * 2**20
        with pytest.raises(ValueError, match="unknown role"):
            await graph.start_node("nope", spec=spec)


def _plan(prefill, decode):
    from aiollm.planner.placement import InstancePlan, Plan

    slo = {"ttft": 0.2, "tpot": 0.1, "attainment": 0.9, "mode": "joint"}
    instance = [None if p is None else InstancePlan(p[0], p[1], p[2], 1.0, 1000) for p in (prefill, decode)]
    return Plan("smollm2", "1x4xA100-80G", "low", "local", "sharegpt", slo, *instance, 1.0, 2.0, 4, True, None, 3, 0.1)


def test_a_plan_becomes_a_spec_that_serve_reads_back(tmp_path):
    from aiollm.deploy.from_plan import plan_header, spec_from_plan

    plan = _plan((2, 1, 1), (1, 1, 2))
    spec = spec_from_plan(plan, ClusterSpec().override({"kv.dtype": "fp16"}))
    assert (spec.prefill.count, spec.prefill.threads, spec.decode.count, spec.decode.threads) == (1, 2, 2, 1)
    assert spec.kv.dtype == "fp16" and not spec.colocated
    path = tmp_path / "planned.toml"
    path.write_text(plan_header(plan) + spec.to_toml())
    assert path.read_text().startswith("# planned for smollm2 on 1x4xA100-80G")
    assert ClusterSpec.from_toml(path) == spec
    assert serve_cli.build_spec(_serve_args(["--config", str(path)])) == spec
    assert spec_from_plan(_plan(None, (1, 1, 1))).colocated
    with pytest.raises(SpecError, match="a colocated plan of 3 instances"):
        spec_from_plan(_plan(None, (1, 1, 3)))


def test_a_listen_address_this_host_cannot_bind_is_refused_before_anything_starts():
    from aiollm.deploy.local import check_addresses

    check_addresses(ClusterSpec())
    with pytest.raises(SpecError, match=r"decode.listen: cannot bind 192.0.2.7 here"):
        check_addresses(ClusterSpec().override({"decode.listen": "tcp://192.0.2.7:0"}))
