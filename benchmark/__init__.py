"""srt's benchmarks, grouped by the question each answers (``benchmark/README.md`` has the
table of scripts, what each measures, how to run it and where its results are documented):

- ``kernel``: what one operation costs (GEMMs, the all-to-all dispatchers, a step's split);
- ``offline``: one static batch or an in-process engine, no server (latency, accuracy);
- ``serving``: a running server under load (throughput, latency, a soak, a peer engine);
- ``cluster``: a multi-node srt in network namespaces on one machine (overlap, faults);
- ``gpu``: the GPU check's parity and figures (``benchmark/gpu_check.sh``);
- ``common``: not a benchmark, what they share: starting and stopping servers and processes,
  ``ip netns`` (shared with the tests), a static batch through a ModelRunner, the same batch
  through HF transformers, the operation timelines.

Each script runs as ``python benchmark/GROUP/SCRIPT.py`` or ``python -m benchmark.GROUP.SCRIPT``
once the project is installed (``make install``).
"""
