"""Speculation: draft trees, verification, the decoding loop and its static (CUDA graph) form,
sampling, and the proposers: EAGLE-2 and EAGLE-3 drafters with their draft heads, Medusa,
independent draft models, prompt lookup."""
