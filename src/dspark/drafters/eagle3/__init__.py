"""Eagle3: one autoregressive layer over the fused target features, in the reference layout
(``eagle3``) and dspark's pre-reference one (``eagle3-fused``) — their kind objects (:mod:`.kind`,
with the checkpoint rules), modules (:mod:`.model`), graphs (:mod:`.graphs`), drafting round
(:mod:`.round`) and training recipe (:mod:`.training`)."""

from dspark.drafters.eagle3.kind import EAGLE3_FUSED_KIND, EAGLE3_KIND, Eagle3Kind

__all__ = ["EAGLE3_KIND", "EAGLE3_FUSED_KIND", "Eagle3Kind"]
