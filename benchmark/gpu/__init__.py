"""The GPU check's Python steps (``benchmark/gpu_check.sh``, ``docs/gpu.md``): parity with HF
transformers, CUDA graphs and host syncs (``gpu_parity``), and the decode figures
(``gpu_report``); what the two share is ``checks``, what the report measures with is
``decode_figures``."""
