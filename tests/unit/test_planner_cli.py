"""`python -m aiollm.plan`: bad inputs exit 2 with a message naming the problem."""

import pytest

from aiollm.cli.plan import main


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--model", "opt-999b", "--cluster", "1x4xA100-80G"], "unknown model 'opt-999b'"),
        (["--model", "opt-13b", "--cluster", "1x4xB300"], "unknown GPU 'B300'"),
        (["--model", "opt-13b", "--cluster", "four-a100s"], "expected NODESxGPUSxGPU"),
        (
            ["--model", "opt-13b", "--cluster", "1x4xA100-80G", "--workload", "tweets", "--profile", "derived"],
            "unknown workload 'tweets'",
        ),
        (["--model", "opt-13b", "--cluster", "1x4xA100-80G", "--profile", "nowhere.json"], "profile 'nowhere.json'"),
    ],
)
def test_bad_inputs_give_clear_errors(argv, message, capsys):
    assert main(["distserve", *argv, "--ttft", "0.2", "--tpot", "0.1"]) == 2
    assert message in capsys.readouterr().err


def test_fastdecode_from_given_measurements(tmp_path, capsys):
    curve = tmp_path / "model.json"
    curve.write_text('{"t_of_b": {"1": 0.01, "64": 0.02, "256": 0.06}}')
    assert (
        main(
            [
                "fastdecode",
                "--seq-len",
                "1024",
                "--t-of-b",
                str(curve),
                "--r-per-token",
                "2e-6",
                "--round-trip",
                "8:0.7,128:2.5",
                "--cores",
                "2",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "P = B*S*R / (2*T(B))" in out and "R-workers" in out
    assert "C(8)=0.70 ms" in out and "all work / cores" in out and "predicted step" in out


def test_fastdecode_prices_a_given_overlap_loss(tmp_path, capsys):
    curve = tmp_path / "model.json"
    curve.write_text('{"t_of_b": {"1": 0.01, "64": 0.02, "256": 0.06}}')
    argv = [
        "fastdecode",
        "--seq-len",
        "1024",
        "--t-of-b",
        str(curve),
        "--r-per-token",
        "2e-6",
        "--round-trip",
        "8:0.7,128:2.5",
        "--cores",
        "2",
    ]
    assert main(argv) == 0
    assert "overlap loss" not in capsys.readouterr().out
    assert main([*argv, "--overlap-loss", "0.3"]) == 0
    assert "overlap loss 0.300 of the lesser side" in capsys.readouterr().out
