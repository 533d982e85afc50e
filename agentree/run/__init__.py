"""The run: `runtime` assembles the parts from a config, `trainer` is the one training loop,
`evaluation` measures held-out success, `checkpoint`/`resume` keep and restore it, `tracking`
writes metrics, `plan` estimates a run's memory and cost before it starts."""
