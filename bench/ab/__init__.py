"""The A/B gate of two checkouts (the plan, both sides' runs, resident side workers, the A/A calibration) and the comparison of releases through their container images."""
