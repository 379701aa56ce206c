"""A multi-node srt on one machine: network namespaces joined by shaped links
(``emulated_network``), the overlap benchmarks on them (``emulated_cluster``, its serving phase
``emulated_serving`` and report ``emulated_report``), faults injected into a 2-node server
(``emulated_faults``), and what a link costs the CPU (``link_cpu``)."""
