"""Checking the predictions against real runs on this machine (proxy-check, link calibration)."""
