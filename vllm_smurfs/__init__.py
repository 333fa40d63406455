"""vllm-smurfs: collective and adaptive speculative decoding for vLLM.

Several drafters (small models and model-free voters) draft in parallel; a weighted majority vote
over their prefix tree picks one chain for the target to verify. Enable it with
``speculative_config={"method": "smurfs", ...}`` (see README.md).
"""

__version__ = "0.1.0"
