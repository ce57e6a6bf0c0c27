"""Speculation: the core (draft trees, verification, sampling, the proposer interface, the
drafting config and registry, the live tree-size rule), the draft vocabularies (vocab/) and
the drafting families (families/: EAGLE-2 and EAGLE-3, prompt lookup and the hybrid, Medusa,
independent draft models). The loop that runs them is decoding/'s."""
