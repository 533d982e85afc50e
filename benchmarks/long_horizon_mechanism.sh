#!/usr/bin/env bash
# The mechanism sweep of docs/results/long-horizon.md on the three long-horizon envs: each
# config's low-success warm start and a strong one (the same recipe at expert probability 0.9,
# built once and cached), two sampling temperatures, six methods at one exact env-step budget
# per task. Resumable: run the same command again and finished levels are kept.
#
#   bash benchmarks/long_horizon_mechanism.sh OUT [TASKS] [TEMPERATURES...]
#
# TASKS held-out tasks a level (default 32), TEMPERATURES the sampling temperatures (default
# 1.0 2.0). Trees of 32 tasks at a time hold several GB on BabyAI: --batch 8 keeps a run
# under about 3 GB.
set -euo pipefail
OUT=${1:?usage: long_horizon_mechanism.sh OUT [TASKS]}
TASKS=${2:-32}
shift $(( $# < 2 ? $# : 2 ))
TEMPERATURES=("$@")
[ ${#TEMPERATURES[@]} -gt 0 ] || TEMPERATURES=(1.0 2.0)
HERE="$(cd "$(dirname "$0")" && pwd)"
run() {  # label config budget policies...
    local label=$1 config=$2 budget=$3
    shift 3
    python "$HERE/tree_mechanism.py" --out "$OUT" --config "$config" --label "$label" \
        --budget "$budget" --tasks "$TASKS" --temperatures "${TEMPERATURES[@]}" --threads 1 \
        --batch 8 --set engine.prefix_cache_mb=256 --policy "$@"
}
# budgets: one round of flat GRPO's group (G=8) at the turn limit (FrozenLake's and Sokoban's
# episodes end early, so that is about 27 and 9 trajectories a task)
run frozenlake8 frozenlake8_patr 128 tiny-warm tiny-warm@0.9
run sokoban2 sokoban2_patr 112 tiny-warm tiny-warm@0.9
# BabyAI last: 32 turns of about 60 tokens each make its rollouts the slowest by far. Two
# rounds of G=8: most of its episodes run the whole 32 turns, and at one round (256) PATR's
# tree is cut before its branches finish (2 finished trajectories a task, 13 cut). Its
# contexts need a prefix cache of about 2 GB (at 256 MB a level takes six times as long).
run babyai babyai_patr 512 tiny-warm tiny-warm@0.9 --set engine.prefix_cache_mb=2048
