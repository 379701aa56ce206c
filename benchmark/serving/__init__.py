"""A running server under load: SGLang-style throughput and latency (``bench_serving`` and its
request, dataset and metrics modules), srt against vLLM's CPU engine on one checkpoint
(``compare_peer``), and a bounded soak of mixed traffic with leak checks (``soak``)."""
