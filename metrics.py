"""
metrics.jsonl, a run's log in out_dir: one JSON object a line, written by train.py's rank 0 and
read by bench.py, compare.py and the tests through rows() and read(). Its rows:

    a step          STEP's keys
    an evaluation   EVALUATION's keys (eval_only adds "evaluated": what it loaded)
    an event        "event": MEMORY (a stage's memory per rank), COMM_PER_STEP (collectives and
                    bytes per step, by kind), SKIPPED_NONFINITE (a step on_nonfinite='skip' skipped)

After a resume a step's iter may come twice; the later row is the resumed run's.
"""
import json
import os
from typing import NamedTuple, Optional

STEP = ("iter", "loss", "grad_norm", "lr", "dt_ms", "tokens_per_sec", "mfu", "peak_mem_mb", "host_ms")
EVALUATION = ("iter", "train_loss", "val_loss")
MEMORY, COMM_PER_STEP, SKIPPED_NONFINITE = "memory", "comm_per_step", "skipped_nonfinite"


class Metrics(NamedTuple):
    steps: list  # in file order
    evals: list  # in file order
    memory: dict  # stage -> its MEMORY row
    comm: Optional[dict]  # the COMM_PER_STEP row, written at the end of a run


def split(rows):
    """A run's rows, in file order -> Metrics."""
    return Metrics(steps=[r for r in rows if "loss" in r], evals=[r for r in rows if "val_loss" in r],
                   memory={r["stage"]: r for r in rows if r.get("event") == MEMORY},
                   comm=next((r for r in rows if r.get("event") == COMM_PER_STEP), None))


def read(path):
    """Metrics of a run dir (or a metrics.jsonl path)."""
    return split(rows(path))


def rows(path):
    """The rows of a run dir's (or a path's) metrics.jsonl, in file order. Lines that are not JSON
    objects (a live run's half-written last line) are skipped."""
    file = os.path.join(path, "metrics.jsonl") if os.path.isdir(path) else path
    if not os.path.isfile(file):
        raise FileNotFoundError(f"no metrics.jsonl in {path}" if file != path else f"{path} does not exist")
    found = []
    with open(file) as f:
        for line in f:
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if isinstance(row, dict):
                found.append(row)
    return found
