"""Helpers of the performance harness."""
