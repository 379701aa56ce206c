"""srt's training sibling: pipeline-parallel schedules (1F1B, interleaved 1F1B, DualPipeV) as
data, a checker that proves a schedule valid, and a simulator of its timeline, bubble and peak
activations. Training is not the server's job, so this lives beside ``srt/``."""
