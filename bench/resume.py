"""What makes a bench resumable: its run dir is pinned to one bench config, so a resumed bench never mixes runs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from jetroll.shared.errors import ConfigError


def claim_run_dir(run_dir: Path, tree: dict[str, Any], bench: str, other: str = "another config") -> None:
    """Write `tree` as the run dir's bench_config.json, or refuse a run dir whose bench_config.json differs."""
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "bench_config.json"
    if path.exists() and json.loads(path.read_text()) != tree:
        raise ConfigError(f"{run_dir} holds {bench}-bench runs of {other} ({path}); pass a new --run-dir")
    path.write_text(json.dumps(tree, indent=2))
