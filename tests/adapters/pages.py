"""Real (or documented, see each file's header) metrics pages of every engine dialect."""

from __future__ import annotations

from pathlib import Path

PAGES = Path(__file__).parent / "pages"
KINDS = ("vllm", "sglang", "trtllm", "triton", "tgi", "llamacpp")


def page(kind: str) -> bytes:
    return (PAGES / f"{kind}.txt").read_bytes()


def replace_line(text: bytes, startswith: bytes, new_line: bytes) -> bytes:
    """The page with every line starting with `startswith` replaced by `new_line`."""
    lines = text.split(b"\n")
    assert any(line.startswith(startswith) for line in lines), f"no {startswith!r} line"
    return b"\n".join(new_line if line.startswith(startswith) else line for line in lines)


def drop_lines(text: bytes, startswith: bytes) -> bytes:
    kept = [line for line in text.split(b"\n") if not line.startswith(startswith)]
    assert len(kept) < text.count(b"\n") + 1, f"no line starts with {startswith!r}"
    return b"\n".join(kept)
