"""The decoding loop: one request's generation (generate.py), the engine that steps one or many
of them (batch.py), graph steps of fixed shapes as a backend (graph_step.py) and the
cost curve the loop's draft budget reads (cost_curve.py). It drives any proposer through the
core's interface (speculation/proposer.py) and imports no drafting family."""
