"""What one operation costs: the CPU GEMMs (``bench_gemm``), the expert-parallel all-to-all
dispatchers (``bench_dispatch``), a step's GEMMs against the rest (``bench_step_split``), and
the per-operation timelines of a step (``op_timeline``, for ``--profile``)."""
