"""The learner seam and what implements it: `base` (Learner, SharedLearner, ShardedLearner),
`update` (one GRPO/DAPO update), `lora`, `sharding` (FSDP2 process groups and a rank's share of
the update) and `launch` (local ranks)."""
