"""moe-engine's benchmark suite: scenario -> run -> result -> gate / report -> release (see docs/code-tour.md)."""
