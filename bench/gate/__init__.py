"""Comparing result sets: verdicts, gates, and the A/B gate between two checkouts."""
