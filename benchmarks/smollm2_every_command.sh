#!/usr/bin/env bash
# SmolLM2-135M-Instruct through every command on every env, one short step each, in process and
# on a local Ray cluster; prints each command's wall time and peak memory (GNU time).
#
#   bash benchmarks/smollm2_every_command.sh OUT_DIR
#
# Needs the `models`, `ray`, `math` and `swe` extras, a running dockerd with the local SWE images
# (`agentree swe images`), and GNU time (/usr/bin/time). Results: docs/results/real-model.md.
set -uo pipefail
out=${1:?usage: smollm2_every_command.sh OUT_DIR}
mkdir -p "$out"
step() {
    echo "=== $1"
    shift
    /usr/bin/time -f "%e s, %M KB" "$@"
    echo "rc=$?"
}
one=(--steps 1 --set train.tasks_per_step=1 --set eval.tasks=2 --set eval.samples=1)
short=(--set engine.max_tokens=64)
swe=(--set env.step_limit=4 --set engine.max_tokens=48 --set eval.tasks=1)
ray=(--set distributed.backend=ray --set distributed.rollout_workers=2 --set train.save_every=0)
keep=(--set train.save_every=1 --set train.trees_every=1)

step countdown-train agentree train --config countdown_latr_smollm2 --output "$out/cd" \
    "${one[@]}" "${short[@]}" "${keep[@]}"
step countdown-sft agentree sft --config countdown_latr_smollm2 --data "$out/cd/trees" \
    --output "$out/cd-sft" --min-reward -100 --epochs 1 --batch-size 4
step countdown-eval agentree eval --config countdown_latr_smollm2 --policy "$out/cd-sft" \
    --tasks 2 --samples 1 "${short[@]}" --output "$out/cd-eval"
step countdown-view agentree view "$out/cd" --output "$out/cd-view.html"
step countdown-ray agentree train --config countdown_latr_smollm2 --output "$out/cd-ray" \
    "${one[@]}" --set train.tasks_per_step=2 --set engine.max_tokens=48 "${ray[@]}"
step math-train agentree train --config math_treepo_smollm2 --output "$out/math" \
    "${one[@]}" "${short[@]}" "${keep[@]}"
step math-rollout agentree rollout --config math_treepo_smollm2 --tasks 1 "${short[@]}" \
    --output "$out/math-rollout"
step swe-train agentree train --config swebench_patr_smollm2 --output "$out/swe" \
    "${one[@]}" "${swe[@]}" "${keep[@]}"
step swe-sft agentree sft --config swebench_patr_smollm2 --data "$out/swe/trees" \
    --output "$out/swe-sft" --min-reward -100 --epochs 1 --batch-size 2
step swe-ray agentree train --config swebench_patr_smollm2 --output "$out/swe-ray" \
    "${one[@]}" --set train.tasks_per_step=2 "${swe[@]}" "${ray[@]}"
step prm-build agentree models prm --base smollm2-135m --env frozenlake --out "$out/prm"
step frozenlake-prm-rollout agentree rollout --config frozenlake_patr_smollm2 --scorer prm \
    --set scorer.model="$out/prm" --tasks 2 --output "$out/fl-prm"
