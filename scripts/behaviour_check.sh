#!/usr/bin/env bash
# Issue 15's "behaviour unchanged" check, extended by issue 50: the smoke job, the first 200 steps of the default job,
# a few steps of the agent job from a fixed base and a FrozenLake (gymnasium) smoke, all in sync mode, from one
# checkout; run once at the pre-refactor commit and once on the refactor, then scripts/compare_runs.py.
# The default, agent and gym jobs run on the exact backend: with the fast one samples join the decode batch as they
# are admitted, so which rows decode together is timing, and the logits' last bits follow it (two runs of one commit
# part at step 2-3, measured); two smoke runs repeat on the fast backend.
# The agent job starts from the base in <agent-base> (a model dir, for example the tests' short agent base in
# ~/.cache/jetroll/tests), copied into its cache, so that both checkouts train the same weights.
# usage: behaviour_check.sh <checkout> <venv> <out> <agent-base>
set -euo pipefail
checkout=$1; venv=$2; out=$3; agent_base=$4
mkdir -p "$out/agent-cache"
cp -r "$agent_base" "$out/agent-cache/"
cd "$checkout"
"$venv/bin/python" -m jetroll.services.cli --help >/dev/null 2>&1 && cli="-m jetroll.services.cli" || cli="-m services.cli"
"$venv/bin/python" $cli run configs/smoke.yaml --run-dir "$out/smoke" --set staleness.mode=sync \
    --set model.cache_dir="$out/cache" > "$out/smoke.log" 2>&1
"$venv/bin/python" $cli run configs/arithmetic.yaml --run-dir "$out/default" --set staleness.mode=sync \
    --max-steps 200 --set precision.backend=exact --set model.cache_dir="$out/cache" > "$out/default.log" 2>&1
# the base's warm start of tests/integration/test_agent_job.py (BASE) and its shortened job (SHORT)
"$venv/bin/python" $cli run configs/agent.yaml --run-dir "$out/agent" --set staleness.mode=sync \
    --set model.warm_start.max_steps=300 --set model.warm_start.target_band=null \
    --set model.warm_start.eval_every=1000 --set model.warm_start.probe_problems=20 \
    --set trainer.groups_per_step=2 --set trainer.group_size=4 --set rollout.max_batch=16 --set eval.every_steps=0 \
    --set eval.num_problems=20 --set trainer.checkpoint_every=2 --set trainer.max_steps=4 \
    --set precision.mode=fp8_unified --set precision.backend=exact \
    --set model.cache_dir="$out/agent-cache" > "$out/agent.log" 2>&1
"$venv/bin/python" $cli run configs/smoke.yaml --run-dir "$out/gym" --set staleness.mode=sync \
    --set "tasks=[{kind: gymnasium, name: frozenlake, max_turns: 8}]" --set rollout.max_seq_len=128 \
    --set model.warm_start.max_steps=150 --set trainer.max_steps=3 --set precision.backend=exact \
    --set model.cache_dir="$out/cache" > "$out/gym.log" 2>&1
sha256sum "$out"/cache/*/model.safetensors "$out"/agent-cache/*/model.safetensors > "$out/base.sha256"
