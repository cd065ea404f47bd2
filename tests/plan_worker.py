"""
plan.py's training steps for real, measured by the allocator's own events, for tests/test_plan.py.

    python tests/plan_worker.py CASES.json OUT.json

CASES.json lists [backend, world size, rank, [--key=value ...]]. For each case this process runs
plan.run() twice: once with fake tensors (the plan), once with real ones under torch.profiler with
profile_memory=True. Both use the fake process group, whose collectives complete at once on this
thread, so every free happens where the program drops its tensor (the collectives' own buffers,
gloo's or NCCL's, are not the program's: test_plan.py checks a gloo run apart). The measured peak is
the running sum of the allocation and free events' bytes, in time order.
"""
import json
import sys
import traceback
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import plan  # noqa: E402


def measured_peak(prof):
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]")
    allocated = peak = 0
    for _, nbytes in events:
        allocated += nbytes
        peak = max(peak, allocated)
    return peak, allocated


def case(backend, world, rank, argv):
    settings = plan.train_settings(argv)
    settings["vocab_size"] = plan.vocab_size(settings)
    planned, planned_state, _ = plan.run(settings, backend, world, rank)
    prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    counted, state, _ = plan.run(settings, backend, world, rank, fake=False, measured=lambda: prof)
    peak, left = measured_peak(prof)
    return {"planned_peak": planned.peak, "planned_state": planned_state, "planned_where": planned.peak_where,
            "counted_real_peak": counted.peak, "measured_peak": peak, "measured_state": state}


def main():
    cases, out_path = json.loads(Path(sys.argv[1]).read_text()), Path(sys.argv[2])
    torch.set_num_threads(1)
    results = {}
    for backend, world, rank, argv in cases:
        key = " ".join([backend, f"W={world}", f"rank={rank}", *argv])
        try:
            results[key] = case(backend, world, rank, argv)
        except Exception:
            results[key] = {"error": traceback.format_exc()}
    out_path.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
