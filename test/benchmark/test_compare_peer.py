"""compare_peer's pure parts: the commands and environments it starts each engine with, the
vLLM CLI wrapper it writes, and the table it prints (no vLLM needed)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from benchmark.serving import compare_peer


def test_server_commands_and_environments():
    args = compare_peer.parse_args(
        ["--model-path", "/m", "--port", "31000", "--srt-args=--tp 2", "--vllm-args=-x"]
    )
    srt = compare_peer.server_command("srt", args, ("py", "cli"))
    assert srt[1:3] == ["-m", "launch_server"] and srt[-2:] == ["--tp", "2"]
    assert "float32" in srt and "31000" in srt
    vllm = compare_peer.server_command("vllm", args, ("py", "cli"))
    assert vllm[:4] == ["py", "cli", "serve", "/m"] and vllm[-1] == "-x"
    env = compare_peer.server_env("vllm", args)
    assert env["VLLM_TARGET_DEVICE"] == "cpu" and env["VLLM_CPU_KVCACHE_SPACE"] == "4"


def test_dtype_goes_to_every_engine_and_into_the_tables(tmp_path):
    def parse(*extra: str):
        return compare_peer.parse_args(["--model-path", "/m", *extra])

    def dtype_of(command: list[str]) -> str:
        return command[command.index("--dtype") + 1]

    assert parse().dtype == "float32"
    args = parse("--dtype", "bfloat16", "--engines", "srt", "--baseline", str(_checkout(tmp_path)))
    for engine in ("srt", "vllm", "base"):
        assert dtype_of(compare_peer.server_command(engine, args, ("py", "cli"))) == "bfloat16"
    assert dtype_of(compare_peer.one_batch_command(args, tmp_path / "r.jsonl")) == "bfloat16"
    assert "bfloat16" in compare_peer.format_table(args, compare_peer.Results()).splitlines()[0]
    assert "float32" in compare_peer.format_table(parse(), compare_peer.Results()).splitlines()[0]


@pytest.mark.parametrize("argv", [["--dtype", "float16"], ["--srt-args=--dtype bfloat16"],
                                  ["--vllm-args=--dtype=bfloat16"]])  # fmt: skip
def test_a_dtype_other_than_dtypes_or_inside_the_extra_flags_is_refused(argv, capsys):
    with pytest.raises(SystemExit):
        compare_peer.parse_args(["--model-path", "/m", *argv])
    assert "--dtype" in capsys.readouterr().err


def test_an_mla_checkpoint_gets_vllms_fp32_mla_backend(tmp_path):
    def vllm_command(*extra: str) -> list[str]:
        args = compare_peer.parse_args(["--model-path", str(tmp_path), *extra])
        return compare_peer.server_command("vllm", args, ("py", "cli"))

    (tmp_path / "config.json").write_text('{"kv_lora_rank": 16}')
    assert vllm_command()[-2:] == ["--attention-backend", "CPU_MLA"]
    assert vllm_command("--vllm-args=--attention-backend X")[-2:] == ["--attention-backend", "X"]
    assert "--attention-backend" not in vllm_command("--dtype", "bfloat16")  # vLLM picks one
    (tmp_path / "config.json").write_text('{"kv_lora_rank": null}')  # a Qwen3-MoE config has none
    assert "--attention-backend" not in vllm_command()


def test_wrapper_maps_the_version_lookup_in_spawned_processes_too(tmp_path):
    wrapper = tmp_path / "cli.py"
    wrapper.write_text(compare_peer.WRAPPER)
    # Run as a spawned child runs its parent's main module: the version lookup of "vllm" is
    # mapped to "vllm-cpu" (not installed here, so the error names it), and the CLI, which
    # would import vllm, does not start.
    code = (
        f"import runpy; runpy.run_path({str(wrapper)!r}, run_name='__mp_main__')\n"
        "import importlib.metadata as m\n"
        "try:\n    m.version('vllm')\nexcept m.PackageNotFoundError as e:\n    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "vllm-cpu" in out.stdout


def test_table_reports_every_run_and_the_ratio_range():
    args = compare_peer.parse_args(["--model-path", "/m", "--concurrency", "1", "8", "--runs", "2"])
    results = compare_peer.Results()
    for ours, peer in ((100.0, 50.0), (90.0, 100.0)):
        results.add("srt", 1, compare_peer.Run(ours, 10.0, 2.0))
        results.add("vllm", 1, compare_peer.Run(peer, 20.0, 3.0))
    table = compare_peer.format_table(args, results)
    row = next(line for line in table.splitlines() if line.startswith("| 1 |"))
    assert "100.0 / 90.0" in row and "50.0 / 100.0" in row and "0.90–2.00×" in row
    missing = next(line for line in table.splitlines() if line.startswith("| 8 |"))
    assert missing.count("-") >= 3  # no runs at concurrency 8: shown as missing, not zero


def test_run_reads_the_gaps_between_chunks():
    data = {"output_throughput": 10.0, "mean_ttft_ms": 5.0, "mean_tpot_ms": 2.0,
            "median_tpot_ms": 1.5, "mean_itl_ms": 3.0, "p99_itl_ms": 9.0, "output_lens": [4, 3, 0],
            "itls": [[2.0, 2.0, 2.0], [1.0], []]}  # fmt: skip
    run = compare_peer.Run.of(data)
    # 7 tokens in 6 chunks: the second request's 3 tokens came in 2
    assert (run.mean_itl_ms, run.p99_itl_ms, run.tokens_per_chunk) == (3.0, 9.0, 7 / 6)
    assert run.tail_ratio == 6.0  # the p99 gap over the median TPOT
    args = compare_peer.parse_args(["--model-path", "/m", "--concurrency", "1"])
    results = compare_peer.Results()
    results.add("srt", 1, run)
    assert "3.0 / 9.0" in compare_peer.format_table(args, results)


def test_paired_runs_give_each_engine_its_port_and_flip_the_order():
    args = compare_peer.parse_args(["--model-path", "/m", "--port", "31000", "--paired"])
    ports = {e: compare_peer.engine_port(e, args) for e in ("srt", "vllm")}
    assert ports == {"srt": 31000, "vllm": 31001}
    assert str(ports["vllm"]) in compare_peer.server_command("vllm", args, ("py", "cli"))
    assert compare_peer.paired_order(["srt", "vllm"], 0) == ["srt", "vllm"]
    assert compare_peer.paired_order(["srt", "vllm"], 1) == ["vllm", "srt"]
    assert "paired" in compare_peer.format_table(args, compare_peer.Results()).splitlines()[0]


def _checkout(root):
    """A directory that passes for an srt checkout."""
    (root / "launch").mkdir()
    (root / "launch" / "launch_server.py").write_text("")
    return root


def test_a_baseline_checkout_is_served_from_its_own_code(tmp_path):
    _checkout(tmp_path)
    args = compare_peer.parse_args(["--model-path", "/m", "--port", "31000", "--paired",
                                    "--engines", "srt", "--baseline", str(tmp_path)])  # fmt: skip
    assert args.engines == ["srt", "base"] and compare_peer.engine_port("base", args) == 31002
    assert compare_peer.parse_args(["--model-path", "/m"]).engines == ["srt", "vllm"]
    command = compare_peer.server_command("base", args, ("py", "cli"))
    assert command[1:3] == ["-m", "launch_server"] and "31002" in command
    # Its srt and launch_server come first on the path, ahead of the installed project's.
    path = compare_peer.server_env("base", args)["PYTHONPATH"].split(os.pathsep)
    assert path[:2] == [str(tmp_path), str(tmp_path / "launch")]
    results = compare_peer.Results()
    results.add("srt", 32, compare_peer.Run(120.0, 10.0, 2.0))
    results.add("base", 32, compare_peer.Run(100.0, 10.0, 2.0))
    table = compare_peer.format_table(args, results, "base")
    assert str(tmp_path) in table.splitlines()[0] and "| srt / base |" in table
    assert "1.20–1.20×" in next(line for line in table.splitlines() if line.startswith("| 32 |"))


def test_a_baseline_must_be_an_srt_checkout(tmp_path, capsys):
    for argv in (["--baseline", str(tmp_path)], ["--engines", "srt", "base"]):
        with pytest.raises(SystemExit):
            compare_peer.parse_args(["--model-path", "/m", *argv])
    assert "--engines base needs --baseline" in capsys.readouterr().err
