"""`serve`'s default threads: the host's cores shared among the processes that compute, unless --threads or a
spec says otherwise."""

import argparse
import os

import pytest

from aiollm.cli.serve import add_arguments, build_spec


def _spec(argv: list[str], tmp_path=None):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return build_spec(parser.parse_args(argv))


@pytest.fixture
def four_cores(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})


def test_colocated_takes_every_core(four_cores):
    assert _spec(["--colocated"]).decode.threads == 4


def test_disaggregated_shares_the_cores(four_cores):
    spec = _spec(["--prefill", "1", "--decode", "1"])
    assert (spec.prefill.threads, spec.decode.threads) == (2, 2)
    spec = _spec(["--prefill", "1", "--decode", "1", "--r-workers", "2"])
    assert (spec.prefill.threads, spec.decode.threads, spec.r_worker.threads) == (1, 1, 1)


def test_threads_flag_and_spec_win(four_cores, tmp_path):
    assert _spec(["--colocated", "--threads", "1"]).decode.threads == 1
    config = tmp_path / "cluster.toml"
    config.write_text("[decode]\nthreads = 3\n")
    assert _spec(["--config", str(config)]).decode.threads == 3


def test_take_turns_gives_every_instance_every_core(four_cores):
    spec = _spec(["--prefill", "1", "--decode", "1", "--take-turns"])
    assert (spec.prefill.threads, spec.decode.threads) == (4, 4)
    assert spec.turns and os.path.isabs(spec.turns)
    assert _spec(["--take-turns"]).turns != spec.turns  # a cluster's own files
    assert _spec(["--take-turns", "--threads", "2"]).decode.threads == 2
    assert _spec([]).turns == ""


@pytest.mark.parametrize("argv", [["--colocated"], ["--r-workers", "1"]])
def test_take_turns_refuses_what_has_no_turns(argv):
    from aiollm.deploy.spec import SpecError

    with pytest.raises(SpecError, match="--take-turns"):
        _spec([*argv, "--take-turns"])


def test_a_host_too_small_to_split_takes_turns_by_default(monkeypatch, tmp_path):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    spec = _spec([])
    assert spec.turns and (spec.prefill.threads, spec.decode.threads) == (2, 2)
    # an explicit split, a spec file, or a shape that has no turns keeps the cores split
    assert _spec(["--threads", "1"]).turns == ""
    assert _spec(["--no-take-turns"]).turns == "" and _spec(["--no-take-turns"]).decode.threads == 1
    config = tmp_path / "cluster.toml"
    config.write_text("[decode]\nthreads = 1\n")
    assert _spec(["--config", str(config)]).turns == ""
    assert _spec(["--r-workers", "1"]).turns == ""
    assert _spec(["--prefill", "2"]).turns == ""
    assert _spec(["--colocated"]).turns == ""
