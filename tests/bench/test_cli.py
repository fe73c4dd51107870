"""`kvgate bench` end to end in virtual time (seconds), and its refusals."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvgate.cli import main


def test_a_tiny_virtual_benchmark_writes_its_report(tmp_path: Path) -> None:
    out = tmp_path / "report"
    argv = ["bench", "virtual", "--preset", "cpu-tiny", "--nodes", "1", "--duration", "12"]
    argv += ["--warmup", "2", "--loads", "1,3", "--policies", "direct,adaptive"]
    argv += ["--seeds", "1", "--capacity-scale", "0.5", "--timeout", "5", "--out", str(out)]
    assert main(argv) == 0
    text = (out / "report.md").read_text()
    assert "--capacity-scale 0.5" in text  # the exact command is in the report
    assert "| 3x | `adaptive` |" in text and "| 1x | `direct` |" in text
    for png in ("goodput_vs_load.png", "timeseries_1x.png", "timeseries_3x.png"):
        assert (out / png).stat().st_size > 10_000


@pytest.mark.parametrize(
    "extra, message",
    [
        (["virtual", "--loads", "0"], "--loads must be positive"),
        (["live-vllm", "--nodes", "2"], "one real engine"),
        (["virtual", "--duration", "-1"], "--duration must be positive"),
    ],
)
def test_bad_arguments_get_a_message_not_a_traceback(
    extra: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["bench", *extra]) == 2
    assert message in capsys.readouterr().err
