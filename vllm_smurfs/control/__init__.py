"""The controller's parts (pure: no vLLM, no torch). The controller itself is
`vllm_smurfs.length_controller`.

- `plan`: what the controller is told of a request, what it decides and what it learns;
- `planner`: one step's plan search and pricing (the plan in hand, model plans, experiments);
- `plan_search`: the arithmetic of plans (the greedy path, prefix sizes, catch-up charges);
- `acceptance`, `step_costs`: what it learns (acceptance per position and band, cost curves);
- `drafting_rules`: the rules a plan is applied by while its step runs;
- `streaming_mode`, `model_drafting`: whether the streaming drafters draft, and who is told;
- `feedback`: the timings and outcomes the controller is told after a step;
- `fixed`: the fixed-lookahead policy.
"""
