"""moe-engine's benchmark suite: scenario -> run -> result -> gate / report -> release (see the README's tour)."""
