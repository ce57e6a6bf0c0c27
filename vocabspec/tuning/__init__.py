"""Tuning for this machine: the tree sizes the autotuner times (autotune.py), whether the
machine was quiet while it timed (machine_load.py), and the proposer a config builds with its
tree sized (proposers.py), the drafter built first and the loop run over it after."""
