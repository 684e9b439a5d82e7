"""Built-in drafters. Neural drafters (dspark, dflash, eagle3) build on the same protocol."""

from dspark.drafters.ngram import NGramDrafter

__all__ = ["NGramDrafter"]
