"""The `agentree` commands: thin wrappers that resolve a config and call the library (`cli`:
train, rollout, eval, sft, view, configs; `serve`, `export`, `plot`, `models`, `swe`)."""
