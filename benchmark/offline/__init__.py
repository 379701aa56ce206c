"""srt without a server: the latency of one static batch through the ModelRunner
(``bench_one_batch``, against HF transformers with ``hf_compare``), the accuracy of an
in-process engine or a server (``eval_accuracy``), and the random checkpoints the other
benchmarks run on (``make_random_model``)."""
