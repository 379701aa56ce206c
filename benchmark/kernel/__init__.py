"""What one operation costs: the CPU GEMMs (``bench_gemm``), the expert-parallel all-to-all
dispatchers (``bench_dispatch``), a step's GEMMs against the rest (``bench_step_split``), and
dual-batch overlap's hand-over (``bench_ubatch_handover``)."""
