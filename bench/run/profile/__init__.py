"""``moe-bench profile-device``'s parts (run in order by ``bench.run.profile_device``): the sweeps of sizes
and their cost (``sweep``), the timer and each curve's points (``curves``), and the profile document and
its YAML (``document``).
"""
