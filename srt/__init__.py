"""srt: an SGLang-style serving runtime for Mixture-of-Experts models."""
