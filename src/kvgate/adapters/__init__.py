"""Engine adapters: one small module per engine dialect (metrics page to `NodeSample`, abort).

`adapter_for(kind)` builds a fresh, per-node adapter. Imports are lazy so that loading the
configuration (which imports `kvgate.adapters.settings`) stays cheap.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvgate.adapters.base import EngineAdapter

KINDS = ("vllm", "sglang", "trtllm", "triton", "tgi", "llamacpp")


def adapter_for(kind: str, *, capacity_tokens: int | None = None) -> EngineAdapter:
    """A new adapter for one node of engine `kind` (adapters keep per-node state).

    `capacity_tokens` is the configured KV capacity, used by dialects whose page lacks it
    (TGI, llama.cpp); the others read it from the page.
    """
    if kind == "vllm":
        from kvgate.adapters.vllm import VllmAdapter

        return VllmAdapter()
    if kind == "sglang":
        from kvgate.adapters.sglang import SglangAdapter

        return SglangAdapter()
    if kind == "trtllm":
        from kvgate.adapters.trtllm import TrtllmAdapter

        return TrtllmAdapter()
    if kind == "triton":
        from kvgate.adapters.triton import TritonAdapter

        return TritonAdapter()
    if kind == "tgi":
        from kvgate.adapters.tgi import TgiAdapter

        return TgiAdapter(capacity_tokens)
    if kind == "llamacpp":
        from kvgate.adapters.llamacpp import LlamacppAdapter

        return LlamacppAdapter(capacity_tokens)
    raise ValueError(f"unknown engine kind {kind!r}: expected one of {', '.join(KINDS)}")
