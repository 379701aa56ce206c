"""What the benchmarks (and the end-to-end tests) share: ``process`` (free ports, process
state and trees, stopping process groups), ``server`` (start a server, wait until it is ready,
stop it), ``netns`` (``ip netns``: namespaces and the processes inside them)."""
