#!/usr/bin/env bash
# Everything a lent GPU is asked, in one call: the NCCL suite, the default's speed and the memory
# plan against CUDA's counters, in that order, each under its own timeout, all within 9 minutes.
#   bash scripts/gpu_check.sh                  # suite, bench and plan
#   bash scripts/gpu_check.sh plan bench       # only those parts, in the order given
#   bash scripts/gpu_check.sh plan-big         # the plan's wider check: 124M at W=4, 1.3B at W=1, 2 and 4
# Data travels with the call: prepare data/shakespeare_char and data/shakespeare here, then name
# their folders in the device tool's carry. The device has no git: BENCH_COMMIT names the commit.
#   device run: command "BENCH_COMMIT=$(git rev-parse --short HEAD) bash scripts/gpu_check.sh" (the
#   hash written out), carry ["data/shakespeare", "data/shakespeare_char"], timeout_s 600
# Writes under $OUT (a temporary folder without it): gpu_check.log, the suite's logs, and
# results/*.json, the files the docs quote once copied into results/.
# A part that would start with under a minute left is skipped and says so; run it in a second call.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT/results"
exec > >(tee -a "$OUT/gpu_check.log") 2>&1
BUDGET_S=${GPU_CHECK_BUDGET_S:-540}
export PYTHONUNBUFFERED=1 WANDB_MODE=disabled
parts=("$@")
[ ${#parts[@]} -gt 0 ] || parts=(suite bench plan)
for p in "${parts[@]}"; do
    case $p in
    suite | bench | plan | plan-big) ;;
    *) echo "error: unknown part '$p' (suite, bench, plan, plan-big)"; exit 2 ;;
    esac
done

left() { echo $((BUDGET_S - SECONDS)); }

# part NAME CAP_S COMMAND...: COMMAND under `timeout`, at most CAP_S and never past the budget
part() {
    local name=$1 cap=$2 t
    shift 2
    t=$(left)
    [ "$t" -lt "$cap" ] || t=$cap
    if [ "$t" -lt 60 ]; then
        echo "== $name: skipped, $(left) s of the budget left"
        return
    fi
    echo "== $name: at most $t s ($(left) s of the budget left)"
    local start=$SECONDS
    timeout -k 20 "$t" "$@"
    echo "== $name: exit $? after $((SECONDS - start)) s"
}

python - <<'EOF'
import platform, torch
cuda = torch.cuda.is_available()
print(f"== {torch.cuda.get_device_name() if cuda else 'no CUDA device'}; torch {torch.__version__}, "
      f"CUDA {torch.version.cuda}, NCCL {'.'.join(map(str, torch.cuda.nccl.version())) if cuda else '-'}, "
      f"Python {platform.python_version()}")
EOF
for f in data/shakespeare_char/train.bin data/shakespeare/train.bin; do
    [ -f "$f" ] || { echo "error: no $f: run data/*/prepare.py and carry data/ with the call"; exit 2; }
done
gpu=$(python -c "import torch; print(torch.cuda.get_device_name().split()[-1].lower() if torch.cuda.is_available() else 'cpu')")
device=$([ "$gpu" = cpu ] && echo cpu || echo cuda)
# W=1, bf16, compile: the default as users run it on one GPU. BENCH_EXTRA and PLAN_EXTRA come last
# in their commands, so they override (a smaller model, to try the script on CPU)
C="--nproc=1 --gradient_accumulation_steps=1 --dataset=shakespeare --eval_iters=0 --device=$device"
C="$C --dtype=bfloat16 --compile=True --exposed=False"
GPT2="--n_layer=12 --n_head=12 --n_embd=768 --block_size=1024"

for p in "${parts[@]}"; do
    case $p in
    suite)
        GPU_SUITE_TIMEOUT_S=$(( $(left) < 300 ? $(left) : 300 )) part suite 330 bash scripts/gpu_suite.sh ;;
    bench)
        part bench-124M 240 python bench.py --backends=ddp,custom_fsdp,fsdp --repeats=2 --steps=20 $C $GPT2 \
            --batch_size=12 --json="$OUT/results/$gpu-w1-124M.json" ${BENCH_EXTRA:-}
        part bench-1p3B 180 python bench.py --backends=ddp,custom_fsdp --repeats=1 --steps=12 $C \
            config/model_1b.py --block_size=1024 --batch_size=8 --json="$OUT/results/$gpu-w1-1p3B.json" ${BENCH_EXTRA:-} ;;
    plan)
        part plan-124M 360 python scripts/plan_check.py --json="$OUT/results/$gpu-plan-124M.json" --nproc=1,2 --repeats=2 \
            --dataset=shakespeare --device=$device --dtype=bfloat16 $GPT2 --batch_size=12 ${PLAN_EXTRA:-} ;;
    plan-big)
        part plan-124M-w4 150 python scripts/plan_check.py --json="$OUT/results/$gpu-plan-124M-w4.json" --nproc=4 --repeats=1 \
            --dataset=shakespeare --device=$device --dtype=bfloat16 $GPT2 --batch_size=12 ${PLAN_EXTRA:-}
        part plan-1p3B 390 python scripts/plan_check.py --json="$OUT/results/$gpu-plan-1p3B.json" --nproc=1,2,4 --repeats=1 \
            --dataset=shakespeare --device=$device --dtype=bfloat16 config/model_1b.py --block_size=1024 \
            --batch_size=4 ${PLAN_EXTRA:-} ;;
    esac
done
echo "== done in $SECONDS s; files under $OUT"
