"""A device profile for pricing tests: h100-sxm with dotted fields replaced."""

from __future__ import annotations

import yaml

from bench.predict.device import DEVICES_DIR, DeviceProfile, profile_from_dict


def profile_with(**overrides) -> DeviceProfile:
    """h100-sxm with each ``"a.b": value`` of ``overrides`` set (``"peak_tflops.bf16": 1000.0``)."""
    data = yaml.safe_load((DEVICES_DIR / "h100-sxm.yaml").read_text())
    for dotted, value in overrides.items():
        target = data
        *path, last = dotted.split(".")
        for key in path:
            target = target[key]
        target[last] = value
    return profile_from_dict(data, "test.yaml")
