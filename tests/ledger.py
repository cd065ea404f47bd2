"""
A script run with the CPU allocator's own ledger on, for tests/test_plan.py: every allocation and
free of PyTorch's CPU allocator, on every thread, logged with the running total it leaves.

    python tests/spawn.py 2 tests/ledger.py LOG_PREFIX train.py [--key=value ...]

Each rank's log goes to LOG_PREFIX.rank<N>.log; its highest `total alloc` is the rank's real peak.
The ledger is c10's report_cpu_memory_usage flag, set through libc10's symbols. The profiler's
memory events are no substitute here: they count a thread's frees only while that thread profiles,
and gloo's worker threads never do, so a tensor the training thread allocated and gloo's thread
released last stays counted for the rest of the run.
"""
import ctypes
import os
import runpy
import sys

import torch

prefix, script = sys.argv[1], sys.argv[2]
log = os.open(f"{prefix}.rank{os.environ.get('RANK', '0')}.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
os.dup2(log, 2)
c10 = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libc10.so"))
ctypes.c_int.in_dll(c10, "FLAGS_caffe2_log_level").value = 0  # (the ledger's lines are INFO)
ctypes.c_bool.in_dll(c10, "FLAGS_caffe2_report_cpu_memory_usage").value = True
sys.argv = sys.argv[2:]
sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
runpy.run_path(script, run_name="__main__")
