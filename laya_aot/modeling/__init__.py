"""The module every artifact is exported from: laya's DecisionModel copied and changed for export (explicit dtypes,
the faithful path's matrix products, attention without L x L masks, rotary tables, the head at the answer rows).

Export time only: the kinds (and through them the build) import it; a serving process never does.
"""
