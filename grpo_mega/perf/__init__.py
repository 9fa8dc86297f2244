"""Performance measurement of a run (memory per phase).

It may import the standard library and (memory figures) torch, nothing of grpo_mega; ``startup`` is import-light
for the command line. Everything above it may import it.
"""
