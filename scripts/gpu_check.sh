#!/usr/bin/env bash
# The GPU check: runs unattended on a machine with one or more NVIDIA GPUs in at most 13 minutes (its steps'
# timeouts; `--no-setup --checks mfu` at most 7.5) and prints
# one JSON summary (exit code 0 when every check passed, 1 otherwise, 2 for a bad option).
#
#   bash scripts/gpu_check.sh [--dry-run] [--no-setup] [--python PY] [--out DIR] [--checks LIST] [--mfu-options LIST]
#
# 1. setup: scripts/setup.sh (.venv with torch==2.13.0: on Linux x86-64 the default package index's wheel
#    is the CUDA 13.0 build; the NVIDIA driver must be 580 or newer); then `env` checks that torch is the
#    pinned version and sees the GPUs (also counted by nvidia-smi).
# 2. equivalence: tp=pp=dp=1 in fp32 and bf16 on one GPU, plus tp2, pp2, dp2 with two or more, each
#    against one-device training on the same GPU (loss and parameter differences in the summary).
# 3. pipeline: `hybridpar bench pipeline --mode compute --backend nccl` at pp=2 (two or more GPUs): our
#    runtime's steps/s over torch.distributed.pipelining's.
# 4. mfu: first the GPU probe (`plan --probe`'s calibration against docs/hardware/dgx-h100.toml or
#    dgx-h200.toml, by the device's name; about 15-30 s, estimated, not yet timed on a GPU), its probed hardware
#    file in DIR/mfu/probed.toml; then MFU and tokens/s of a ~1B-parameter Llama (dim 2048, 18 layers, 16
#    heads, ffn 5632, vocab 32000, seq 2048) in bf16 on one GPU, under each option of a table (eager, working
#    copies, unfused AdamW, compile + copies, compile, compile + copies in one microbatch: `--mfu-options`
#    names others), each in a process of its own under a timeout within the step's budget (400 s), with the
#    attention kernel taken and each loss curve against the eager run's; the planner's eager-step prediction
#    with the probed file beside the measured step. DIR/mfu.json is rewritten as each piece finishes, so a
#    kill keeps what finished.
# --checks runs a subset (comma-separated, from env,equivalence,pipeline,mfu; env always runs): on a lent
# machine with minutes to spare, `--no-setup --checks mfu` alone fits one call.
# Every step has a hard timeout (`timeout`); the checks' files and logs stay in --out (default
# runs/gpu_check/<time>). --dry-run runs steps 2-4 on CPU processes over gloo with tiny sizes, as if
# there were two GPUs, and setup only checks the environment: everything but CUDA itself runs anywhere.
set -uo pipefail
cd "$(dirname "$0")/.."
dry=0
setup=1
py=.venv/bin/python
out="runs/gpu_check/$(date +%Y%m%d-%H%M%S)"
checks=equivalence,pipeline,mfu
mfu_options=()
while [ $# -gt 0 ]; do
    case "$1" in
        --dry-run) dry=1 ;;
        --no-setup) setup=0 ;;
        --python) py="${2:?--python needs a path}"; shift ;;
        --out) out="${2:?--out needs a directory}"; shift ;;
        --checks) checks="${2:?--checks needs a list}"; shift ;;
        --mfu-options) mfu_options=(--options "${2:?--mfu-options needs a list}"); shift ;;
        *) echo "gpu_check.sh: unknown option $1 (options: --dry-run, --no-setup, --python PY, --out DIR, --checks LIST, --mfu-options LIST)" >&2; exit 2 ;;
    esac
    shift
done
for c in ${checks//,/ }; do
    case "$c" in env|equivalence|pipeline|mfu) ;; *) echo "gpu_check.sh: unknown check $c in --checks (checks: env, equivalence, pipeline, mfu)" >&2; exit 2 ;; esac
done
mkdir -p "$out"
flags=()
[ "$dry" = 1 ] && flags+=(--dry-run)
rcs=()

# run NAME SECONDS COMMAND...: one step under its timeout (4x with --dry-run: CPU ranks on what may be a
# small, shared machine), its output in $out/NAME.log
run() {
    local name=$1 secs=$(( $2 * (dry ? 4 : 1) ))
    shift 2
    PYTHONUNBUFFERED=1 timeout -k 10 "$secs" "$@" >"$out/$name.log" 2>&1
    local rc=$?
    rcs+=(--rc "$name=$rc")
    echo "gpu_check: $name exit code $rc (log: $out/$name.log)" >&2
    return $rc
}

if [ "$dry" = 0 ] && [ "$setup" = 1 ]; then
    run setup 120 bash scripts/setup.sh
fi
# wants NAME: whether --checks names it
wants() { [[ ",$checks," == *",$1,"* ]]; }
if run env 30 "$py" -m hybridpar.bench.gpu_check env --out "$out/env.json" "${flags[@]}"; then
    wants equivalence && run equivalence 120 "$py" -m hybridpar.bench.gpu_check equivalence --out "$out/equivalence.json" "${flags[@]}"
    wants pipeline && run pipeline 90 "$py" -m hybridpar.bench.gpu_check pipeline --out "$out/pipeline.json" "${flags[@]}"
    wants mfu && run mfu 420 "$py" -m hybridpar.bench.gpu_check mfu --out "$out/mfu.json" "${mfu_options[@]}" "${flags[@]}"
fi
"$py" -m hybridpar.bench.gpu_check summary --dir "$out" --checks "env,$checks" "${rcs[@]}" "${flags[@]}" | tee "$out/summary.json"
"$py" -c "import json, sys; sys.exit(0 if json.load(open(sys.argv[1]))['passed'] else 1)" "$out/summary.json"
