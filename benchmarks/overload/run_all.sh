#!/usr/bin/env bash
# Re-run the whole overload benchmark and rewrite the committed reports.
#   virtual: 16 x gpu-8b, 4 loads x 6 policies x 3 seeds, 240 s each  (~30-40 min, 2 cores)
#   live-sim: 2 x cpu-tiny engines behind `kvgate serve`, real HTTP      (~15 min)
#   live-vllm: the real vLLM CPU engine, direct vs adaptive              (~8 min)
# Live runs must have the machine to themselves: they measure real time.
set -euo pipefail
cd "$(dirname "$0")/../.."
KVGATE="${KVGATE:-kvgate}"
OUT=benchmarks/overload/results
"$KVGATE" bench virtual --preset gpu-8b --nodes 16 --duration 240 --seeds 1,2,3 --jobs 2 \
  --out "$OUT/virtual-gpu-8b"
"$KVGATE" bench live-sim --nodes 2 --duration 60 --loads 0.5,1,2,3 --out "$OUT/live-sim"
"$KVGATE" bench live-vllm --duration 60 --loads 1,2,3 --out "$OUT/live-vllm"
