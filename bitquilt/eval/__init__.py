"""Evaluation: perplexity, zero-shot tasks, reports."""

from bitquilt.eval.ppl import PerplexityResult, perplexity

__all__ = ["PerplexityResult", "perplexity"]
