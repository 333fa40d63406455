"""The drafters: where drafts come from.

- `in_worker`, `in_worker_kv`: a model drafter in the target's worker (vLLM's draft-model
  machinery, the default placement) and the KV cache its layers get;
- `process_client`, `process_server`, `protocol`, `channel`: a model drafter in its own process
  (its own vLLM engine streaming drafts), the target's end, the messages, the socket end that
  never blocks the target;
- `ray_actor`, `ray_cluster`: the same drafter as a Ray actor, and the cluster it runs on;
- `model_free`: the n-gram and suffix voters (pure);
- `sampling`: sampled drafts at temperature > 0 and the mixture q the target verifies against.
"""
