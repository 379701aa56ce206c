"""Expert-parallel load balancing (EPLB): where each MoE layer's experts live across EP ranks,
with redundant copies of the hottest ones, chosen from measured per-expert loads
(``algorithm``)."""
