"""SWE tasks in Docker sandboxes that fork mid-episode, graded the SWE-bench way.

- `env`: `SWEEnv`, the agent-facing environment (registered as `swebench`).

- `runtime`: the shared Docker client, resource labels and cleanup (at exit, on SIGTERM, and
  `agentree swe cleanup` for what a crashed run left behind).
- `sandbox`: a container with bounded `exec` and `snapshot`/`restore` through `docker commit`.
- `store`: the containers and snapshot images behind sandboxes: reference-counted snapshot
  images shared by every sandbox in the process, prewarmed spare containers.
- `instances`: SWE-bench (classic and 5.x), R2E-Gym and local records as one `SWEInstance`.
- `grading`: apply a patch in a fresh container, run the instance's tests, decide resolved with
  the `swebench` log parsers and grading functions.
- `images`: the Debian base image and the bundled local suite (`local_suite/`), built locally.

Nothing here imports docker at module import time.
"""
