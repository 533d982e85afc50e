"""Models agentree trains for itself: supervised fine-tuning (`sft`), the warm-start policies
that `policy.path: tiny-warm` / `warm` name (`warm`), and the tiny PRM with a trained value head
(`prm_build`). Built once into the cache of `agentree.hub.store`."""
