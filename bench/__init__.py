"""moe-engine's benchmark suite (micro-benchmarks now; the scenario runner builds on it)."""
