"""Where lm-evaluation-harness stands here, without importing it: whether it is installed (an
optional dependency), and the folder of the tasks the project ships."""

from __future__ import annotations

import importlib.util
from pathlib import Path

BUNDLED_TASKS = Path(__file__).resolve().parents[1] / "tasks"
"""The tasks the project ships: YAML files and the JSONL data they name (moe/tools/task_data.py)."""
INSTALL = "pip install -c constraints.txt -e '.[eval]'"


def lm_eval_missing() -> str | None:
    """Why the harness cannot run here (with the install command), or None."""
    if importlib.util.find_spec("lm_eval") is None:
        return f"lm-evaluation-harness (lm-eval) is not installed: {INSTALL}"
    return None
