"""Building SWE tasks and warm starts: `mutate` (bug injection by AST mutation), `generate` (new
tasks from the local suite's repositories), `expert` (the scripted expert's demonstrations and
the SWE warm-start policy). The environment and its sandboxes are in `agentree.envs.swe`."""
