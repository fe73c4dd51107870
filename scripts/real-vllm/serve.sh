#!/usr/bin/env bash
# Start the real vLLM (CPU build) OpenAI-compatible server on 127.0.0.1 with a deliberately
# small KV cache, serving the tiny random-weight model installed by
# scripts/install-real-vllm.sh. Runs in the foreground; stop it with SIGTERM (2-4 s).
# What the engine is and what was measured with it: README.md beside this script.
#
# Usage: serve.sh [PORT]          (default 8000)
# Env knobs (defaults in brackets):
#   KVGATE_VLLM_ROOT [${XDG_CACHE_HOME:-~/.cache}/kvgate-vllm]
#   VENV [ROOT/venv]  MODEL [ROOT/tiny-llama]
#   KV_BYTES [8388608 = 8 MiB = 4096 tokens for this model at 2 KiB/token]
#   BLOCK_SIZE [32]  MAX_NUM_SEQS [32]  MAX_MODEL_LEN [2048]
#   EXTRA ["--enforce-eager"; set EXTRA="" to let vLLM torch.compile the model]
#   ENGINE_CPUS [every CPU this process may use but the last; the only one if just one]
#
# The engine runs pinned to ENGINE_CPUS, its compute threads and its busy-polling
# processes alike, and leaves the other CPU to kvgate and the clients, as a GPU engine
# leaves the host's CPUs to them. Unpinned on a 2-CPU Firecracker VM, the engine's worker
# and its EngineCore (which spins while it waits for the worker) took both vCPUs, and every
# other process, bash's `sleep 0.01` included, stood still for 2.7-3.3 s while two
# requests decoded: kvgate's polls and the tests' clients saw nothing of that time.
set -euo pipefail
PORT="${1:-8000}"
ROOT="${KVGATE_VLLM_ROOT:-${XDG_CACHE_HOME:-$HOME/.cache}/kvgate-vllm}"
VENV="${VENV:-$ROOT/venv}"
MODEL="${MODEL:-$ROOT/tiny-llama}"
EXTRA="${EXTRA---enforce-eager}"

export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
export VLLM_HOST_IP=127.0.0.1  # keep vLLM's internal sockets on loopback
unset VLLM_CPU_KVCACHE_SPACE  # legacy GiB knob; it would override --kv-cache-memory-bytes
if [ -z "${ENGINE_CPUS:-}" ]; then
  ENGINE_CPUS="$("$VENV/bin/python" -c 'import os
cpus = sorted(os.sched_getaffinity(0))
print(",".join(map(str, cpus[:-1] or cpus)))')"
fi
export VLLM_CPU_OMP_THREADS_BIND="$ENGINE_CPUS" VLLM_CPU_NUM_OF_RESERVED_CPU=0

# `vllm serve` dies at start in vllm-cpu 0.32.0 (its CLI asks importlib.metadata for a
# distribution named "vllm", but this one is named "vllm-cpu"), so run the same server
# through its module entry point, which takes the same flags.
# shellcheck disable=SC2086
exec taskset -c "$ENGINE_CPUS" "$VENV/bin/python" -m vllm.entrypoints.launchers.api_server.entry --model "$MODEL" \
  --host 127.0.0.1 --port "$PORT" \
  --load-format dummy \
  --served-model-name tiny-llama \
  --dtype bfloat16 \
  --max-model-len "${MAX_MODEL_LEN:-2048}" \
  --kv-cache-memory-bytes "${KV_BYTES:-8388608}" \
  --block-size "${BLOCK_SIZE:-32}" \
  --max-num-seqs "${MAX_NUM_SEQS:-32}" \
  --no-enable-prefix-caching \
  $EXTRA
