"""Comparing result sets: grouping, metric and work verdicts, accepted changes, the gate's verdict and its paired statistics."""
