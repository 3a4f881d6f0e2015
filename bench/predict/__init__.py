"""Arithmetic that predicts a run without running it: the plan and the cluster projection."""
