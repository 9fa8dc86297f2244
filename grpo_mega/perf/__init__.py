"""Performance measurement of a run (memory per phase)."""
