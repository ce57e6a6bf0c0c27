"""Benchmarking, which the core never imports: Spec-Bench runs side by side and the serving
benchmark."""
