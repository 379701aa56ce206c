"""Weight quantization: which format a checkpoint's weights come in (``config``) and the
block-FP8 format itself (``fp8``)."""
