"""The `fzero` command line: estimate's table, bench's forwarding, one-line errors."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from fzero._tools import _cli
from fzero._tools._cli import main
from fzero._tools._numbers import parse_count


def _error_line(capsys: pytest.CaptureFixture[str], argv: list[str], code: int = 2) -> str:
    """Runs `fzero argv`, expecting exit `code` with exactly one line on stderr."""
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == code
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("fzero: error: "), captured.err
    assert captured.out == ""
    return lines[0]


def _table(out: str) -> dict[int, list[str]]:
    """Rows of estimate's table: world size -> cells such as "31.4 GB"."""
    rows = {}
    for line in out.splitlines():
        head, *rest = line.split() or [""]
        if head.replace(",", "").isdigit() and rest:
            rows[int(head.replace(",", ""))] = [f"{a} {b}" for a, b in zip(rest[::2], rest[1::2])]
    return rows


@pytest.mark.parametrize("params", ["7.5B", "7.5e9", "7_500_000_000", "7.5b"])
def test_estimate_reproduces_the_zero_paper(
    params: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # ZeRO (arXiv 1910.02054), Table 1 and Figure 1: 7.5B parameters, mixed-precision
    # Adam (K = 12), N = 64 data-parallel ranks.
    assert main(["estimate", "--params", params, "--world-sizes", "1,64"]) == 0
    rows = _table(capsys.readouterr().out)
    assert rows[64] == ["120 GB", "31.4 GB", "16.6 GB", "1.88 GB"]
    assert rows[1] == ["120 GB"] * 4  # one rank: nothing to shard


def test_estimate_flags_change_the_table(capsys: pytest.CaptureFixture[str]) -> None:
    # fp32 Adam, 1e9 parameters: 4 B params + 4 B grads + 8 B moments = 16 GB on one
    # rank; at stage 2 over 4 ranks, 4 + (4 + 8) / 4 = 7 B per parameter.
    argv = ["estimate", "--params", "1e9", "--world-sizes", "4", "--stages", "2,3"]
    assert main([*argv, "--param-bytes", "4", "--grad-bytes", "4", "--optim-bytes", "8"]) == 0
    assert _table(capsys.readouterr().out)[4] == ["7 GB", "4 GB"]
    assert main([*argv, "--unit", "MiB"]) == 0  # 2 + 14/4 and 16/4 bytes, in MiB
    assert _table(capsys.readouterr().out)[4] == ["5,245 MiB", "3,815 MiB"]


def test_estimate_says_what_fzero_stage_3_holds_under_mixed_precision(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # fzero's stage-3 shards are the fp32 masters: (0 + 2 + 12) / 4 bytes per parameter,
    # as `shard_state(precision=)` holds them (tests/state/test_precision.py measures it).
    argv = ["estimate", "--params", "1e9", "--world-sizes", "4", "--stages", "3"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert _table(out)[4] == ["4 GB"] and "--param-bytes 0" in out
    assert main([*argv, "--param-bytes", "0"]) == 0
    out = capsys.readouterr().out
    assert _table(out)[4] == ["3.5 GB"] and "--param-bytes 0" not in out


def test_parse_count() -> None:
    assert parse_count("1.3e9") == 1_300_000_000
    assert parse_count("350M") == parse_count("350m") == 350_000_000
    assert parse_count("1.5T") == 1_500_000_000_000
    assert parse_count("12345") == 12345


@pytest.mark.parametrize(
    "argv, names",
    [
        (["demo", "--world-size", "0"], "--world-size"),
        (["demo", "--steps", "x"], "--steps"),
        (["demo", "--stage", "4"], "--stage"),
        (["demo", "--bogus"], "--bogus"),
        (["demo", "--launcher", "torchrun"], "RANK"),  # not under torchrun
        (["estimate", "--params", "lots"], "--params"),
        (["estimate", "--params", "0"], "--params"),
        (["estimate", "--world-sizes", "8,0"], "--world-sizes"),
        (["estimate", "--stages", "1,5"], "--stages"),
        (["estimate", "--optim-bytes", "-4"], "--optim-bytes"),
        (["frobnicate"], "frobnicate"),
        ([], "required"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(
    argv: list[str], names: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert names in _error_line(capsys, argv)


def test_library_value_errors_are_usage_errors(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # A ValueError raised by fzero on the user's values is reported like a bad flag.
    def refuse(*args: object, **kwargs: object) -> None:
        raise ValueError("need world_size >= 1 and num_params >= 0")

    monkeypatch.setattr(_cli, "estimate_memory", refuse)
    assert "num_params" in _error_line(capsys, ["estimate"])


@pytest.mark.slow
@pytest.mark.multiprocess
def test_python_m_fzero_reports_one_line() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "fzero", "estimate", "--world-sizes", "four"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.splitlines() == [
        "fzero: error: argument --world-sizes: expected comma-separated integers, got 'four' "
        "(see 'fzero estimate --help')"
    ]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_bench_forwards_flags_to_benchmarks_run(capfd: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--help"]) == 0  # run.py's own help, so its flags are listed
    out = capfd.readouterr().out
    assert "--configs" in out and "--steps" in out and "--quick" in out


@pytest.mark.slow
@pytest.mark.multiprocess
def test_bench_rejects_bad_flags_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    line = _error_line(capsys, ["bench", "--configs", "ddp,nope", "--steps", "3"])
    assert "nope" in line


def test_bench_without_a_source_checkout(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # fzero installed from a wheel: no benchmarks/ next to the package.
    monkeypatch.setattr(
        _cli, "__file__", str(tmp_path / "site-packages" / "fzero" / "_tools" / "_cli.py")
    )
    assert "benchmarks" in _error_line(capsys, ["bench", "--quick"], code=1)


def test_estimate_prints_communication_per_axis(capsys: Any) -> None:
    base = "estimate --params 1000 --world-sizes 4 --stages 3 --comm-bytes 4".split()  # noqa: SIM905
    assert main([*base, "--shard-size", "2"]) == 0
    out = capsys.readouterr().out
    # HSDP stage 3: 3 x 4 kB inside a group (two gathers, a reduce-scatter), 2 x 2 kB across.
    assert "groups of 2 shard, the groups replicate" in out and "12 KB / 4 KB" in out
    assert main([*base, "--hpz", "2", "--qwz", "--qgz"]) == 0
    out = capsys.readouterr().out
    assert "hpZ groups of 2; qwZ + qgZ int8" in out and "4 KB / 2.03 KB" in out


def test_estimate_shards_memory_over_the_groups_of_a_2d_mesh(capsys: Any) -> None:
    # HSDP shards the state over a group of S ranks: the memory table divided by N.
    argv = "estimate --params 1000 --world-sizes 3,4 --param-bytes 4 --grad-bytes 4".split()  # noqa: SIM905
    assert main([*argv, "--optim-bytes", "8", "--shard-size", "2", "--unit", "B"]) == 0
    out = capsys.readouterr().out
    memory = out.split("Communication")[0].splitlines()  # the table before the traffic's
    rows = {line.split()[0]: line.split()[1:] for line in memory if line[:10].strip()}
    # Stage 1: 4 + 4 bytes a parameter kept whole, 8 / 2; stage 3: 16 / 2.
    assert " ".join(rows["4"][:8]) == "16,000 B 12,000 B 10,000 B 8,000 B"
    assert rows["3"][:4] == ["-"] * 4  # 2 does not divide 3: no such mesh
    assert "sharded over groups of 2 ranks" in out


def test_estimate_prints_the_offload_arithmetic(capsys: pytest.CaptureFixture[str]) -> None:
    # ZeRO-Offload's case: 7B parameters of mixed-precision Adam on one rank. The 12
    # bytes a parameter of fp32 masters and moments leave the device; 2 + 2 stay.
    argv = ["estimate", "--params", "7B", "--world-sizes", "1,8", "--offload", "host"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    rows = {
        line.split()[0]: line.split()[1:]
        for line in out.splitlines()
        if line[:10].strip() in ("1", "8")
    }
    assert " ".join(rows["1"]) == "- 28 GB + 84 GB 28 GB + 84 GB 28 GB + 84 GB"
    assert " ".join(rows["8"]).endswith("3.5 GB + 10.5 GB")  # (2 + 2) * 7B / 8 + 12 * 7B / 8
    assert "--param-bytes 0" not in out  # the device keeps a bf16 shard beside the masters
    assert main([*argv[:-1], "disk", "--offload-fraction", "0.5"]) == 0
    assert "70 GB + 42 GB" in capsys.readouterr().out  # half of the 84 GB stays: 28 + 42
    line = _error_line(capsys, [*argv, "--offload-fraction", "0"])
    assert "(0, 1]" in line
    # ZeRO-Infinity's parameter offload: stage 3's bf16 shards on the host too (2 + 12
    # bytes a parameter there); stages 1-2 keep replicas and are printed as before.
    assert main([*argv, "--offload-params"]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line[:10].strip() == "1").split()
    assert " ".join(row[1:]) == "- 28 GB + 84 GB 28 GB + 84 GB 14 GB + 98 GB"
    assert "the parameter shards on the host too" in out


def test_estimate_does_what_every_flag_asks(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A flag that changes nothing printed was silently ignored: a share of an offload not
    asked for is refused, as --offload-params alone is, and --comm-bytes prints the table
    it sizes. One rank communicates nothing."""
    base = ["estimate", "--params", "7B", "--world-sizes", "1,8"]
    assert "--offload-fraction needs --offload" in _error_line(
        capsys, [*base, "--offload-fraction", "0.5"]
    )
    assert main([*base, "--comm-bytes", "1"]) == 0
    out = capsys.readouterr().out
    assert "1 bytes per element otherwise" in out
    rows = {line.split()[0]: line.split()[1:] for line in out.splitlines() if " / " in line}
    assert set(rows["1"]) == {"0", "B", "/"}  # "0 B / 0 B" in every stage
    assert rows["8"][:4] == ["0", "B", "/", "14"]  # stage 0: 2 x 7B x 1 byte, across
