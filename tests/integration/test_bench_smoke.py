"""CI smoke of `jetroll bench engine`: a few tokens, so the benchmark cannot rot. Speed is not asserted."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


@pytest.mark.integration
def test_bench_engine_json_smoke() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "services.cli", "bench", "engine", "--json", "--batch-sizes", "1,2",
         "--new-tokens", "8", "--repeats", "1", "--threads", "1"],
        capture_output=True, text=True, timeout=300, check=True,
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert [row["batch_size"] for row in result["rows"]] == [1, 2]
    for row in result["rows"]:
        assert row["hf_tokens_per_s"] > 0 and row["jetroll_fp32_tokens_per_s"] > 0
        assert row["jetroll_fp8_tokens_per_s"] > 0
    summary = result["summary"]
    assert {"speedup_b1", "speedup_b64", "fp8_over_fp32"} <= set(summary)
    assert summary["speedup_b1"] > 0
