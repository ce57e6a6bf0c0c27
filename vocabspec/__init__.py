"""vocabspec: lossless speculative decoding for large-vocabulary language models on any device."""

from .serving.api import LanguageModel, load

__all__ = ["LanguageModel", "load"]
__version__ = "0.1.0"
