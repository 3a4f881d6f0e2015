"""``moe-bench profile-device``: the sweeps of sizes and their cost (``sweep``), the timer and each curve's
points (``curves``), the profile document and its YAML (``document``), and the measurement that runs them in
order (``measure``).
"""
