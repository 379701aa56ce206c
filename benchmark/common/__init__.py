"""What the benchmarks (and the end-to-end tests) share: ``process`` (free ports, process
state and trees, stopping process groups), ``server`` (start a server, wait until it is ready,
stop it), ``netns`` (``ip netns``: namespaces and the processes inside them), ``static_batch``
(one static batch through a ModelRunner, no server), ``hf_compare`` (the same batch through HF
transformers), ``op_timeline`` (the per-operation timelines of ``--profile``) and
``expert_skew`` (routers skewed to a power law, the routing of a checkpoint measured)."""
