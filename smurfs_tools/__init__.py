"""Tools beside the plugin, not needed to serve: engine jobs in processes of their own for side by
side comparisons (`jobs`), the demo (`demo`), tiny models for tests and the demo
(`tiny_models`)."""
