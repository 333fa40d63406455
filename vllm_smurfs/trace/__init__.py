"""Step traces: the format the proposer writes (`format`, the only part the runtime imports),
and offline work on recorded traces: the simulator that replays the controller
(`simulator`), the reconstruction of what each drafter would have drafted (`reconstruct`), the
reports and the command line (`report`; ``python -m vllm_smurfs.trace``)."""
