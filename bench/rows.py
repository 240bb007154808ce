"""What a bench reads back from its runs: JSON-lines files (a job's metrics and evaluations, a peer's step clock)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Every row of a JSON-lines file, in order."""
    return [json.loads(line) for line in path.read_text().splitlines()]
