"""What layers call inside a forward to overlap communication: the operations a layer is made
of (``operations``), single-batch overlap's blocked combine (``single_batch_overlap``) and
dual-batch overlap's hand-over hooks (``ubatch_context``). The planners and executors that
drive them per step are ``srt.batch_overlap``; nothing here imports them."""
