"""Constrained decoding: regex / JSON-schema grammars that mask the sampler's choices.

`GrammarCache.get(kind, pattern)` compiles (once per pattern) an index over the model's
vocabulary with the grammar backend; each constrained request gets its own matcher that
says which tokens may come next and follows the tokens actually sampled.
"""

from lmprog_runtime.constrained.base import BaseGrammarBackend, Grammar, Matcher
from lmprog_runtime.constrained.grammar_cache import GrammarCache

__all__ = ["BaseGrammarBackend", "Grammar", "GrammarCache", "Matcher"]
