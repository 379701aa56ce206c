"""srt's training sibling: pipeline-parallel schedules (1F1B, interleaved 1F1B, DualPipeV) as
data, a checker that proves a schedule valid, a simulator of its timeline, bubble and peak
activations, and an executor that trains a small MoE model by any of them (expert parallelism
inside the stages, DualPipeV's forward/backward overlap). Training is not the server's job, so
this lives beside ``srt/``."""
