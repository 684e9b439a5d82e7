"""DSpark: DFlash's parallel backbone (:mod:`dspark.drafters.dflash`) + a sequential head + a
confidence head — its kind object (:mod:`.kind`), module (:mod:`.model`), graphs
(:mod:`.graphs`) and drafting round (:mod:`.round`); it trains with DFlash's recipe (the module's
``refine`` applies the heads)."""

from dspark.drafters.dspark.kind import DSPARK_KIND, DSparkKind

__all__ = ["DSPARK_KIND", "DSparkKind"]
