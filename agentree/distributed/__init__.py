"""Scale-out runtime on Ray: rollout workers, engine replicas, asynchronous rollouts.

Nothing here is imported by `import agentree`; `distributed.backend=ray` loads it. The pieces:

- `cluster`: connect to (or start) a Ray cluster; start/stop a local test cluster.
- `engine`: `EngineReplica` actor (a transformers engine) and `RemoteEngine`, the client that
  implements the `agentree.engines.base.Engine` protocol with prefix-affinity routing.
- `scorer`: `ScorerActor`, one shared actor for a scorer that holds a model (PRM), and
  `RemoteScorer`, the client the workers' controllers call.
- `worker`: `RolloutWorker` actor; it builds an ordinary `agentree.rollouts.LocalRollouts` and
  runs the same controller code (`agentree.rollout.*`) that runs in-process, one chunk of trees
  per call.
- `scheduler`: `RayRollouts` (the Ray side of the `agentree.rollouts.Rollouts` seam), which
  owns the actors, balances trees across workers, turns dead or hung workers into `env_error`
  trees, syncs weights through the object store and reports `distributed/*` metrics.
- `ranks`: training ranks as Ray actors, each running the entry-point function it is given.
"""
