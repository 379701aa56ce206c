"""srt without a server: the latency of one static batch through the ModelRunner
(``bench_one_batch``, also against HF transformers), what a prefill costs the decoding requests
(``bench_mixed_step``), the accuracy of an in-process engine or a server (``eval_accuracy``),
and the random checkpoints the other benchmarks run on (``make_random_model``)."""
