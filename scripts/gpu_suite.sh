#!/usr/bin/env bash
# The GPU suite in one command: tests/test_cuda.py (one process on the GPU) and tests/test_cuda_multi.py
# (W ranks as fake hosts on that one GPU, over NCCL), then a short summary: the device, pytest's
# counts, and each comparison with its world size and largest difference.
#   bash scripts/gpu_suite.sh                 # from anywhere; about 5 minutes on one H100 or H200
#   bash scripts/gpu_suite.sh -k fp32         # extra arguments go to pytest
# Exits with pytest's code (124 past GPU_SUITE_TIMEOUT_S, default 540 s). Where $OUT names a folder
# (the device tool's), the log and the summary are copied there.
set -uo pipefail
cd "$(dirname "$0")/.."
work=$(mktemp -d)
export GPU_SUITE_SUMMARY=$work/summary.jsonl
timeout -k 30 "${GPU_SUITE_TIMEOUT_S:-540}" \
    python -m pytest -q -rA -p no:cacheprovider tests/test_cuda.py tests/test_cuda_multi.py "$@" 2>&1 |
    tee "$work/pytest.log"
code=${PIPESTATUS[0]}
if [ "$code" = 124 ]; then
    # pytest was killed before its launches could stop their fake hosts (each torchrun leads a session
    # of its own): stop every process that carries a fake-hosts launch's marker
    for proc in /proc/[0-9]*; do
        if tr '\0' '\n' < "$proc/environ" 2>/dev/null | grep -q '^FAKEHOSTS_LAUNCH='; then
            kill -9 "${proc#/proc/}" 2>/dev/null
        fi
    done
fi
python - "$work" "$code" > "$work/summary.txt" <<'EOF'
import json, re, sys
from pathlib import Path
import torch
work, code = Path(sys.argv[1]), sys.argv[2]
log = (work / "pytest.log").read_text()
device = torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA device"
nccl = ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else "-"
print(f"== GPU suite: exit {code}; {device}; torch {torch.__version__}, NCCL {nccl}")
counts = re.findall(r"(\d+) (passed|failed|skipped|errors?)", log.strip().splitlines()[-1] if log.strip() else "")
print("pytest: " + (", ".join(f"{n} {what}" for n, what in counts) or "no result line (killed?)"))
for line in log.splitlines():
    if line.startswith(("FAILED", "ERROR", "SKIPPED")):
        print("  " + line[:200])
path = work / "summary.jsonl"
for r in map(json.loads, path.read_text().splitlines() if path.exists() else []):
    fields = {k: v for k, v in r.items() if k not in ("check", "world", "ok", "want", "max_rel_diff")}
    diff = f"max rel diff {r['max_rel_diff']:.3g}" if "max_rel_diff" in r else ""
    mark = "ok  " if r.get("ok", True) else "DIFF"
    print(f"  {mark} W={r.get('world', '-')}: {r['check']}: want {r.get('want', '-')}; {diff} {fields or ''}".rstrip())
EOF
cat "$work/summary.txt"
if [ -n "${OUT:-}" ] && [ -d "$OUT" ]; then
    cp "$work"/* "$OUT"/
fi
exit "$code"
