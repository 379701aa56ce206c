"""Expert-parallel load balancing (EPLB): where each expert of a MoE layer lives.

A *logical* expert is one of the model's experts; a *physical* expert is one copy of it in
one slot of one rank. ``ep_size × local`` slots hold ``num_experts + redundant`` copies, so
hot experts can have several. ``expert_location`` holds the placement and turns a router's
logical choices into physical ones; ``algorithm`` computes a placement from recorded load.
"""
