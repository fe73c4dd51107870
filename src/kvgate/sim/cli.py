"""`kvgate sim`: N simulated vLLM engines on consecutive ports, in one process.

    kvgate sim --nodes 4 --preset cpu-tiny --port 8000

prints one line per engine with its URL once it accepts connections, and exits cleanly on
SIGINT or SIGTERM. Engine options override the preset's values. vLLM's
`--enable-prefix-caching` and `--kv-events-config` turn on the prefix cache and its KV
events (`kvgate.sim.kv_publisher`; engine i publishes on the configured ports + i).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from kvgate.sim.presets import PRESETS  # light: no aiohttp

    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument(
        "--port", type=int, default=8000, help="first engine's port (8000; 0: any free ports)"
    )
    parser.add_argument("--nodes", type=int, default=1, help="number of engines (1)")
    parser.add_argument(
        "--preset", default="cpu-tiny", choices=sorted(PRESETS), help="engine model (cpu-tiny)"
    )
    parser.add_argument("--model-name", default="sim-llama", help="served model name")
    parser.add_argument("--num-blocks", type=int, help="KV blocks, vLLM's num_gpu_blocks")
    parser.add_argument("--block-size", type=int, help="tokens per KV block")
    parser.add_argument("--max-num-seqs", type=int, help="running sequences at most")
    parser.add_argument("--max-num-batched-tokens", type=int, help="token budget per step")
    parser.add_argument("--max-model-len", type=int, help="longest prompt + output")
    parser.add_argument(
        "--scheduling", choices=["fcfs", "priority"], help="waiting-queue order (fcfs)"
    )
    parser.add_argument(
        "--eos-mean-tokens",
        type=float,
        help="mean output length when EOS is sampled (requests without ignore_eos)",
    )
    parser.add_argument(
        "--no-abort-on-disconnect",
        action="store_true",
        help="keep generating for clients that left (zombie requests)",
    )
    parser.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        help="real seconds per simulated second (2 = run twice as slow)",
    )
    parser.add_argument(
        "--chars-per-token", type=float, default=4.0, help="text prompt length estimate (4.0)"
    )
    parser.add_argument("--seed", type=int, default=0, help="PRNG seed; engine i uses seed+i")
    parser.add_argument(
        "--enable-prefix-caching",
        action="store_true",
        help="cache full KV blocks across requests, as vLLM's flag does",
    )
    parser.add_argument(
        "--kv-events-config",
        help='vLLM\'s JSON, e.g. \'{"enable_kv_cache_events": true, "publisher": "zmq", '
        '"endpoint": "tcp://*:5557"}\': publish KV events (needs the kv-events extra)',
    )


def run(args: argparse.Namespace) -> int:
    from kvgate.sim.presets import get_preset

    if args.nodes < 1 or not 0 <= args.port <= 65535 or args.port + args.nodes - 1 > 65535:
        print(
            "kvgate sim: --nodes must be >= 1 and the ports must fit below 65536", file=sys.stderr
        )
        return 2
    try:
        config = get_preset(
            args.preset,
            num_blocks=args.num_blocks,
            block_size=args.block_size,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=args.max_model_len,
            scheduling=args.scheduling,
            eos_mean_tokens=args.eos_mean_tokens,
            abort_on_disconnect=False if args.no_abort_on_disconnect else None,
            enable_prefix_caching=True if args.enable_prefix_caching else None,
        )
        if args.kv_events_config is not None:
            from kvgate.sim.kv_publisher import KVEventsConfig

            args.kv_events = KVEventsConfig.from_json(args.kv_events_config)
            if args.kv_events is not None:
                args.kv_events.check(args.nodes)
        else:
            args.kv_events = None
    except ModuleNotFoundError as exc:
        print(
            f"kvgate sim: --kv-events-config needs the Python package {exc.name!r}: "
            "pip install 'kvgate[kv-events]'",
            file=sys.stderr,
        )
        return 2
    except (KeyError, ValueError) as exc:
        print(f"kvgate sim: {exc}", file=sys.stderr)
        return 2
    with contextlib.suppress(ImportError):
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    try:
        return asyncio.run(_serve(args, config))
    except OSError as exc:
        print(f"kvgate sim: cannot listen: {exc}", file=sys.stderr)
        return 1


async def _serve(args: argparse.Namespace, config: object) -> int:
    from kvgate.sim.model.engine import Engine, EngineConfig
    from kvgate.sim.server import SimServer

    assert isinstance(config, EngineConfig)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    servers: list[SimServer] = []
    try:
        for i in range(args.nodes):
            publisher = None
            if args.kv_events is not None:
                from kvgate.sim.kv_publisher import KVPublisher

                publisher = KVPublisher(args.kv_events.for_engine(i))
            server = SimServer(
                Engine(config, seed=args.seed + i, record_kv_events=publisher is not None),
                model_name=args.model_name,
                chars_per_token=args.chars_per_token,
                time_scale=args.time_scale,
                preset=args.preset,
                kv_publisher=publisher,
            )
            servers.append(server)
            port = await server.start(args.host, args.port + i if args.port else 0)
            kv = config.num_blocks * config.block_size
            events = f", KV events on {publisher.endpoint}" if publisher is not None else ""
            print(
                f"engine {i}: http://{args.host}:{port}  ({args.preset}: {config.num_blocks}"
                f" blocks x {config.block_size} = {kv} KV tokens, max_num_seqs "
                f"{config.max_num_seqs}, abort_on_disconnect {config.abort_on_disconnect}, "
                f"prefix caching {config.enable_prefix_caching}{events})",
                flush=True,
            )
        await stop.wait()
    finally:
        for server in servers:
            await server.close()
    return 0
