#!/usr/bin/env bash
# Issue 15's "behaviour unchanged" check: the smoke job and the first 200 steps of the default job, both in sync
# mode, from one checkout; run once at the pre-refactor commit and once on the refactor, then scripts/compare_runs.py.
# The default job runs on the exact backend: with the fast one its 128 samples join the decode batch as they are
# admitted, so which rows decode together is timing, and the logits' last bits follow it (two runs of one commit
# part at step 2-3, measured); two smoke runs repeat on the fast backend.
# usage: behaviour.sh <checkout> <venv> <out>
set -euo pipefail
checkout=$1; venv=$2; out=$3
mkdir -p "$out"
cd "$checkout"
"$venv/bin/python" -m jetroll.services.cli --help >/dev/null 2>&1 && cli="-m jetroll.services.cli" || cli="-m services.cli"
"$venv/bin/python" $cli run configs/smoke.yaml --run-dir "$out/smoke" --set staleness.mode=sync \
    --set model.cache_dir="$out/cache" > "$out/smoke.log" 2>&1
"$venv/bin/python" $cli run configs/arithmetic.yaml --run-dir "$out/default" --set staleness.mode=sync \
    --max-steps 200 --set precision.backend=exact --set model.cache_dir="$out/cache" > "$out/default.log" 2>&1
sha256sum "$out"/cache/*/model.safetensors > "$out/base.sha256"
