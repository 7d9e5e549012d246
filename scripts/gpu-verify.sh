#!/usr/bin/env bash
# Issues #8, #17, #27, #29 and #38: every CUDA path, the offload / fine-tune / prefetch / pipeline benchmarks and the
# L2L recipes (full and LoRA fine-tunes) on one GPU machine.
#
#   scripts/gpu-verify.sh pack   # here (no GPU): copy the pure-Python packages the GPU image
#                                # lacks (hydra-core, omegaconf, antlr4, litgpt, torchdata, ...) into .gpu-site/ (git-ignored)
#   scripts/gpu-verify.sh run [PART]   # there: PART is tests, bench, recipes or all (default)
#
# The device tool runs one command for at most 10 minutes, so call it once per part:
#   run(command="scripts/gpu-verify.sh run tests", carry=[".gpu-site"])    # -m cuda, then the suite
#   run(command="scripts/gpu-verify.sh run bench", carry=[".gpu-site"])    # offload, finetune, prefetch, pipeline tables
#   run(command="scripts/gpu-verify.sh run recipes", carry=[".gpu-site"])  # Llama 3.2 1B under L2L bf16, a 7B LoRA, measured
#   run(command="scripts/gpu-verify.sh run estimate", carry=[".gpu-site"]) # a plain bf16 GPT's device estimate, measured
#   run(command="scripts/gpu-verify.sh run tier", carry=[".gpu-site"])     # issue #49's NVMe tier with pinned buffers: the
#       tier tests on CUDA (bit for bit against the run in memory; the pinned rings' bytes held to the plan, issue 59),
#       torch.cuda.gds where present, bench offload --nvme
#   run(command="scripts/gpu-verify.sh run schedules", carry=[".gpu-site"]) # not in all: issue #30's schedule table on this
#       machine's unshared CPU cores (2 gloo ranks, sleeping blocks; ~4 min): on the 2-core sandbox its zero-bubble target
#       sits inside the spread (docs/pipeline.md), a core coming back cold from every sleep
# The recipes and estimate parts run each recipe through `lightning-accel estimate RECIPE ... --measure STEPS`
# (issue #29): the estimate's table, the run, then each device's estimated peak beside
# torch.cuda.max_memory_allocated (goal: within 10%; outside it the step reads FAILED (rc 1)).
# Each step is cut at $STEP_LIMIT seconds (default 540) and then reads FAILED (rc 124) in the
# table instead of losing the part's results. Full logs land in $OUT (or ./gpu-results):
# versions.txt, tests-cuda.log, tests-all.log, bench-offload.txt, bench-finetune.txt, bench-prefetch.txt,
# bench-pipeline.txt, recipe-llama-1b.log, recipe-qwen-7b-lora.log, estimate-gpt-small.log, summary.txt.
# The package itself is used from the working tree (PYTHONPATH): the GPU image's torch
# (2.11 + CUDA) stays, and nothing is fetched there.
set -uo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
cd "$repo"

pack() {
    local site
    site=$(python -c 'import hydra, os; print(os.path.dirname(os.path.dirname(hydra.__file__)))') || {
        echo "pack needs hydra-core importable here: activate the dev venv (.venv/bin/activate)" >&2; exit 2; }
    rm -rf .gpu-site && mkdir -p .gpu-site
    # hydra-core and omegaconf for the recipes; litgpt (and the pure-Python packages it imports that the
    # image lacks) for the real-model tests; torchdata for the resumable loaders; peft (and accelerate, which
    # it imports) and torchao for model/adapter=lora|qlora (NF4 is plain PyTorch in torchao: its compiled
    # kernels are not needed). The image has transformers, pillow and lightning of its own.
    for pkg in hydra omegaconf antlr4 litgpt jsonargparse docstring_parser typeshed_client torchdata peft accelerate torchao; do
        [ -e "$site/$pkg" ] || { echo "pack: $pkg is not installed in $site; pip install -e '.[test]' there first" >&2; exit 2; }
        cp -r "$site/$pkg" .gpu-site/
    done
    du -sh .gpu-site
}

run() {
    local part=${1:-all}
    case "$part" in tests|bench|recipes|estimate|schedules|all) ;; *) echo "run: unknown part '$part'; use tests, bench, recipes, estimate, schedules or all" >&2; exit 2 ;; esac
    local out="${OUT:-$repo/gpu-results}"
    mkdir -p "$out"
    export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
    [ -d .gpu-site ] && export PYTHONPATH="$PYTHONPATH:$repo/.gpu-site"
    export PYTHONUNBUFFERED=1 LIGHTNING_ACCEL_CACHE="${TMPDIR:-/tmp}/la-cache" LIGHTNING_ACCEL_OUTPUTS="${TMPDIR:-/tmp}/la-outputs"
    python3 - > "$out/versions.txt" <<'PY' || { cat "$out/versions.txt"; echo "no CUDA device: nothing to verify" >&2; exit 2; }
import datetime, subprocess, torch, lightning, hydra
assert torch.cuda.is_available(), "torch.cuda.is_available() is False"
smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                     capture_output=True, text=True).stdout.strip()
print(f"date {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC")
print(f"gpu {smi}")
print(f"torch {torch.__version__} (cuda {torch.version.cuda}), lightning {lightning.__version__}, hydra {hydra.__version__}")
PY
    cat "$out/versions.txt"
    local status=()
    step() {  # name, log, command...
        local name=$1 log=$2; shift 2
        echo "+ $*" | tee "$out/$log"
        local start=$SECONDS
        if timeout "${STEP_LIMIT:-540}" "$@" >> "$out/$log" 2>&1; then status+=("$name|ok|$((SECONDS - start)) s|$log");
        else status+=("$name|FAILED (rc $?)|$((SECONDS - start)) s|$log"); fi
        tail -n 25 "$out/$log"
    }
    if [ "$part" = tests ] || [ "$part" = all ]; then
        step "GPU-only tests (-m cuda)" tests-cuda.log python3 -m pytest -m cuda -ra -q tests
        step "whole suite, CUDA visible" tests-all.log python3 -m pytest -ra -q -m "not xla" -p no:cacheprovider tests
    fi
    if [ "$part" = bench ] || [ "$part" = all ]; then
        step "bench offload" bench-offload.txt python3 -m lightning_accel.cli bench offload
        # LoRA / QLoRA rows on the GPU, with the 70B-block bus-vs-compute arithmetic at the measured bus speed
        step "bench finetune" bench-finetune.txt python3 -m lightning_accel.cli bench finetune --layers 8 --width 1024 --seq 512
        step "bench prefetch" bench-prefetch.txt python3 -m lightning_accel.cli bench prefetch --steps 60
        step "bench pipeline (memory vs M)" bench-pipeline.txt python3 -m lightning_accel.cli bench pipeline --memory-only
    fi
    if [ "$part" = recipes ] || [ "$part" = all ]; then
        # the 1B recipe's memory figures in its header are the estimate's; this runs 20 steps with the recipe's own
        # settings (OffloadMonitor's summary line: peak device bytes) and puts max_memory_allocated beside the estimate
        step "recipe llama-3.2-1b l2l bf16" recipe-llama-1b.log python3 -m lightning_accel.cli estimate llama-3.2-1b_l2l-bf16_1gpu \
            trainer.val_check_interval=20 trainer.limit_val_batches=2 --measure 20
        # a 7B LoRA fine-tune on a random bf16 base (no download): 5 steps if the host has the ~16 GB for the base
        step "recipe qwen2.5-7b lora l2l" recipe-qwen-7b-lora.log python3 -m lightning_accel.cli estimate qwen2.5-7b_lora-l2l_1gpu \
            trainer.val_check_interval=5 trainer.limit_val_batches=1 --measure 5
    fi
    if [ "$part" = estimate ] || [ "$part" = all ]; then
        # plain Lightning (bf16-mixed, gradient accumulation) on one GPU: parameters, gradients, AdamW state, activations
        step "estimate gpt-small bf16 1gpu" estimate-gpt-small.log python3 -m lightning_accel.cli estimate gpt-small_bf16-accum_1gpu \
            trainer.val_check_interval=10 trainer.limit_val_batches=1 --measure 10
    fi
    if [ "$part" = tier ] || [ "$part" = all ]; then
        # issue #49: pinned O_DIRECT buffers under a CUDA device (the cuda-marked tier test compares with the run in memory)
        step "NVMe tier tests" tier-tests.log python3 -m pytest -ra -q -p no:cacheprovider tests/strategies/test_l2l_tier.py \
            tests/strategies/test_l2l_materialize.py tests/offload/test_disk_io.py tests/offload/test_tier_plan.py \
            tests/offload/test_staging.py tests/strategies/test_l2l_gpu_path.py
        step "torch.cuda.gds present" tier-gds.log python3 -c "import torch, torch.cuda.gds as g; print('gds', hasattr(g, 'GdsFile'))"
        step "bench offload --nvme" bench-offload-nvme.txt python3 -m lightning_accel.cli bench offload --nvme
    fi
    if [ "$part" = schedules ]; then  # CPU ranks: whether issue #30's zero-bubble target holds where cores are not shared
        step "bench pipeline --schedules all" bench-schedules.txt python3 -m lightning_accel.cli bench pipeline --schedules all
    fi
    {
        cat "$out/versions.txt"
        printf '%-32s %-14s %-8s %s\n' step result time log
        for row in "${status[@]}"; do IFS='|' read -r a b c d <<< "$row"; printf '%-32s %-14s %-8s %s\n' "$a" "$b" "$c" "$d"; done
    } > "$out/summary.txt"
    echo; cat "$out/summary.txt"
    ! grep -q FAILED "$out/summary.txt"
}

case "${1:-}" in
    pack) pack ;;
    run) run "${2:-all}" ;;
    *) echo "usage: $0 pack|run [tests|bench|recipes|estimate|tier|schedules|all]  (pack here, run on the GPU machine; see the header)" >&2; exit 2 ;;
esac
