"""Serving: continuous batching, the OpenAI-compatible server, and `vocabspec.load`, the API."""
