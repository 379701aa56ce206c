"""Write a mid-size random Qwen3-MoE checkpoint for benchmarks (hidden 1024, 8 layers, 16
experts, top-2), with the tiny models' tokenizer. Deterministic; about 0.9 GB in float32.

    python benchmark/make_random_model.py --out-dir DIR
"""

from __future__ import annotations

import argparse
from pathlib import Path

from make_tiny_models import (
    EOS_TOKEN,
    _write_json,
    build_tokenizer,
    make_tensors,
    qwen3_moe_config,
    qwen3_moe_shapes,
    save_tokenizer,
    save_weights,
    unprintable_token_ids,
)

MID_SIZE = {
    "hidden_size": 1024,
    "num_hidden_layers": 8,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "num_experts": 16,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 512,
    "intermediate_size": 2048,
}


def make_mid_size_model(out_dir: str) -> str:
    out = Path(out_dir)
    if (out / "config.json").exists():
        return str(out)
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer()
    eos_id = tok.token_to_id(EOS_TOKEN)
    vocab_size = -(-tok.get_vocab_size() // 8) * 8
    cfg = qwen3_moe_config(vocab_size, eos_id) | MID_SIZE
    tensors = make_tensors(
        "mid-qwen3-moe", qwen3_moe_shapes(cfg), unprintable_token_ids(tok, vocab_size)
    )
    save_tokenizer(tok, out)
    save_weights(tensors, out, num_shards=4)
    _write_json(out / "config.json", cfg)  # written last: its presence means complete
    return str(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", required=True)
    print(make_mid_size_model(parser.parse_args().out_dir))


if __name__ == "__main__":
    main()
