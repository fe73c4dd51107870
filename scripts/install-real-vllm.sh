#!/usr/bin/env bash
# Install the real vLLM CPU engine and its tiny model once, into a cache outside the repo.
# Reused by later runs; a cold install takes about 2 minutes and 3.5 GB.
set -euo pipefail
ROOT="${KVGATE_VLLM_ROOT:-${XDG_CACHE_HOME:-$HOME/.cache}/kvgate-vllm}"
HERE="$(cd "$(dirname "$0")" && pwd)"
SHARED="${KVGATE_SHARED:-$HERE/../../shared}"
if [ -x "$ROOT/venv/bin/python" ] && [ -f "$ROOT/tiny-llama/config.json" ] \
   && "$ROOT/venv/bin/python" -c "import vllm" 2>/dev/null; then
  echo "real vLLM already installed in $ROOT"
  exit 0
fi
echo "installing the real vLLM CPU engine into $ROOT (about 2 minutes the first time)"
bash "$SHARED/real-vllm/setup.sh" "$ROOT"
