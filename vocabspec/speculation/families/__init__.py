"""The drafting families, one module each with its own build function and registration
(config.register): EAGLE-2 and EAGLE-3 (eagle.py, eagle3.py, built by eagle_family.py), prompt
lookup (pld.py), the two together (hybrid.py), Medusa (medusa.py) and an independent draft
model (draft_model.py). They import only the core (speculation/'s own modules and vocab/) and
the engine; importing this package registers them all."""

# In the order --draft lists them.
from . import eagle_family, pld, hybrid, medusa, draft_model  # noqa: F401,I001  (their registrations)
