"""Executing scenarios: the run loop, worker processes, the measured steps, proxy ranks."""
