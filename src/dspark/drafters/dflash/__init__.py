"""DFlash: the parallel backbone alone — its kind object (:mod:`.kind`), module (:mod:`.model`),
graphs (:mod:`.graphs`), drafting round (:mod:`.round`), training recipe (:mod:`.training`) and
checkpoint rules (:mod:`.formats`). DSpark (:mod:`dspark.drafters.dspark`) builds on it."""

from dspark.drafters.dflash.kind import DFLASH_KIND, BlockKind

__all__ = ["DFLASH_KIND", "BlockKind"]
