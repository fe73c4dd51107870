"""`kvgate bench` end to end in virtual time (seconds), and its refusals."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kvgate.cli import main


def test_a_tiny_virtual_benchmark_writes_its_report(tmp_path: Path) -> None:
    out = tmp_path / "report"
    argv = ["bench", "virtual", "--preset", "cpu-tiny", "--nodes", "1", "--duration", "12"]
    argv += ["--warmup", "2", "--loads", "1,3", "--policies", "direct,adaptive"]
    argv += ["--seeds", "1", "--capacity-scale", "0.5", "--timeout", "5", "--out", str(out)]
    assert main([*argv, "--clients-say-timeout"]) == 0
    text = (out / "report.md").read_text()
    assert "--capacity-scale 0.5" in text  # the exact command is in the report
    assert "--clients-say-timeout" in text
    assert "sent with each try as a proxy's route timeout" in text
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


_WITHOUT_BENCH_EXTRA = """
import sys
sys.modules["numpy"] = None  # as if `pip install kvgate` had not brought the bench extra
sys.modules["matplotlib"] = None
from kvgate.cli import main
sys.exit(main(sys.argv[1:]))
"""


def _without_extra(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", _WITHOUT_BENCH_EXTRA, *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_help_works_and_a_run_names_the_extra_without_it() -> None:
    helped = _without_extra("bench", "--help")
    assert helped.returncode == 0, helped.stderr
    for option in ("virtual,live-sim,live-vllm", "--loads", "--policies", "--quick"):
        assert option in helped.stdout
    assert "pip install 'kvgate[bench]'" in " ".join(helped.stdout.split())
    for argv in (["bench", "virtual", "--quick"], ["bench", "virtual", "--policies", "seed"]):
        ran = _without_extra(*argv)
        assert ran.returncode == 2 and "Traceback" not in ran.stderr
        assert ran.stderr.strip() == (
            "kvgate bench needs the Python package 'numpy': pip install 'kvgate[bench]'"
        )
