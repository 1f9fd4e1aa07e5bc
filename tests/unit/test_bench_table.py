"""bench/table.py: the performance table from benchmark JSON, and the README region it rewrites."""

import argparse
import json
import os

import pytest

from bench import table


def _write(path, figures, mtime=None):
    path.write_text(json.dumps(figures))
    if mtime is not None:
        os.utime(path, (mtime, mtime))


def _rows_by_key(results_dir):
    results = {bench: table.read_results(results_dir, bench) for bench in table.benches()}
    return {r["figure"].split("`")[1]: r for r in table.rows(results)}, results


def test_rows_show_values_targets_and_benches_not_run(tmp_path):
    _write(
        tmp_path / "attention.json",
        {"ratio_fp16_vs_read_bw": 0.947, "ratio_int8_vs_fp16": 1.29, "cpu": "Test CPU 9000", "isa": "avx512"},
        mtime=1_800_000_000,  # 2027-01-15 UTC
    )
    _write(
        tmp_path / "fastdecode.json",
        {
            "fastdecode_best_tokens_per_s": 853.14,
            "ratio_predicted_vs_measured_step": 1.2,
            "finished_throughput": "2027-01-16 10:00:00 UTC",
            "finished_trace": "2027-01-17 09:00:00 UTC",
        },
    )
    by_key, results = _rows_by_key(tmp_path)

    assert by_key["ratio_fp16_vs_read_bw"] == {
        "bench": "attention",
        "figure": "`ratio_fp16_vs_read_bw`: fp16 KV read rate / the memory's read bandwidth",
        "value": "0.947",
        "target": ">= 0.9",
        "met": "yes",
    }
    assert (by_key["ratio_int8_vs_fp16"]["value"], by_key["ratio_int8_vs_fp16"]["met"]) == ("1.29", "no")
    assert by_key["ratio_fp16_vs_sdpa_bf16"]["value"] == "not measured"
    assert by_key["fastdecode_best_tokens_per_s"]["value"] == "853 tokens/s"
    assert by_key["ratio_predicted_vs_measured_step"]["target"] == "1 ± 0.15"
    assert by_key["ratio_predicted_vs_measured_step"]["met"] == "no"
    assert by_key["ratio_decode_vs_transformers"]["value"] == "not run"
    assert by_key["ask_rtt_pinned_us"]["target"] == "<= 40 µs"
    assert {r["bench"] for r in by_key.values()} == set(table.benches())

    assert results["attention"].date == "2027-01-15"  # from the file's mtime
    assert results["fastdecode"].date == "2027-01-17"  # from its latest finished_* key
    assert table.header(results, cpu="Other CPU") == "Measured on Test CPU 9000, 2027-01-15 to 2027-01-17."


def test_missing_or_unreadable_results(tmp_path):
    text = table.build(tmp_path / "absent", cpu="Test CPU")
    assert text.startswith("No benchmark results yet")
    assert text.count("| not run |") == len(table.FIGURES)

    (tmp_path / "model.json").write_text("{not json")
    by_key, results = _rows_by_key(tmp_path)
    assert by_key["ratio_decode_vs_transformers"]["value"] == "unreadable JSON"
    assert results["model"].error.startswith("unreadable JSON")


def test_header_names_this_cpu_without_a_cpu_key(tmp_path):
    _write(tmp_path / "serve.json", {"ratio_goodput_disagg_vs_colocated": 2.0, "date": "2027-02-01"})
    text = table.build(tmp_path, cpu="Test CPU 42")
    assert text.splitlines()[0] == "Measured on Test CPU 42, 2027-02-01."
    assert "| serve | `ratio_goodput_disagg_vs_colocated`: " in text
    assert "| 2 | >= 2 | yes |" in text


def test_this_cpu_reads_the_model_name(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nmodel name\t: AMD EPYC  9R14 96-Core Processor\nflags\t: avx2\n")
    assert table.this_cpu(cpuinfo) == "AMD EPYC 9R14 96-Core Processor"
    assert table.this_cpu(tmp_path / "absent") == ""


def test_rewrite_region_replaces_only_between_the_markers():
    readme = f"# title\n\nbefore\n{table.START}\nold table\nold line\n{table.END}\nafter\n"
    out = table.rewrite_region(readme, "| new |")
    assert out == f"# title\n\nbefore\n{table.START}\n| new |\n{table.END}\nafter\n"
    assert table.rewrite_region(out, "| new |") == out
    with pytest.raises(ValueError, match="bench-table"):
        table.rewrite_region("# no markers\n", "| new |")


def test_command_rewrites_the_readme(tmp_path, capsys):
    results = tmp_path / "results"
    results.mkdir()
    _write(results / "transport.json", {"ratio_ask_rtt_vs_raw": 2.25, "date": "2027-03-01"})
    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{table.START}\n{table.END}\nend\n")
    parser = argparse.ArgumentParser()
    table.add_arguments(parser)
    assert table.main(parser.parse_args(["--results", str(results), "--readme", str(readme)])) == 0
    text = readme.read_text()
    assert text.startswith(f"intro\n{table.START}\nMeasured on ")
    assert "| transport | `ratio_tcp_vs_raw_64MiB`: tcp transport / raw sockets, 64 MiB frames | not measured |" in text
    assert "| 2.25 | <= 3 | yes |" in text
    assert text.endswith(f"{table.END}\nend\n")

    readme.write_text("no markers\n")
    assert table.main(parser.parse_args(["--results", str(results), "--readme", str(readme)])) == 1
    assert "bench-table" in capsys.readouterr().err
