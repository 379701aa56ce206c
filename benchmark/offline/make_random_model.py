"""Write a random Qwen3-MoE checkpoint for benchmarks, with the tiny models' tokenizer.
Deterministic. Presets:

- ``mid`` (default): hidden 1024, 8 layers, 16 experts top-2; about 0.9 GB in float32.
- ``emulated``: hidden 1024, 4 layers, 8 experts top-2 with small experts (intermediate 64)
  and 4 attention heads: the all-to-all bytes of a token stay those of hidden 1024 while its
  compute shrinks, so that on one CPU core per node compute and communication are of the same
  order over a 1 Gbit/s link (the emulated-cluster benchmark).
- ``small``: Qwen3-MoE, hidden 96, 3 layers, 12 experts top-3, head_dim 32: every op is tiny,
  so per-step host overhead decides the speed (the serving comparison with vLLM).
- ``deepseek-v3``: DeepSeek-V3 shape (MLA with kv_lora_rank 512 and rope dim 64, the only MLA
  shape vLLM's CPU kernel takes; sigmoid grouped routing with correction bias, a shared
  expert, one dense first layer), hidden 256, 4 layers, 16 experts top-4.
- ``qwen3-30b-a3b-4l``: Qwen3-30B-A3B's layer shape (hidden 2048, 128 experts top-8 of
  intermediate 768, 32 query / 4 KV heads of head_dim 128, vocab 151936) with 4 of its 48
  layers, stored in bf16 (about 6 GB): a decode step reads what one of the real model's would,
  per layer, for the GPU figures (``benchmark/gpu/gpu_report.py``). Token ids past the tokenizer's
  512 only pad the vocabulary; their logits are damped like the other unprintable ones.

``--quantization fp8`` writes any preset as a block-FP8 checkpoint in the published format
(``benchmark/common/fp8_checkpoint.py``, 128 × 128 blocks; partial edge blocks where a dimension
is no multiple of 128, as in ``small``, ``emulated`` and ``deepseek-v3``); ``--fp8-copy DIR``
keeps the unquantized checkpoint and writes such a copy of it beside (the GPU check's two).

``--expert-skew S`` (S >= 0) biases every MoE layer's router so that the expert of popularity
rank r receives a share of the routed tokens proportional to 1 / r**S (none above 1 / top_k),
which expert holds which rank a seeded permutation per layer (group by group where the routing
is group-limited, as in ``deepseek-v3``): the checkpoints of the expert-parallel load balancing
benchmarks. 0, the default, writes the unbiased routers (the checkpoint byte for byte as
without the flag). The routing is fitted to the model's own hidden states through HF
transformers (``benchmark/common/expert_skew.py`` says how; Qwen3-MoE presets also get one
shared vector added to every embedding row). The writer then runs the checkpoint through HF
transformers, in its stored dtype, on 512 random tokens the fit never saw and prints the share
of the routed tokens the hottest 10 % of experts take (per-layer mean). For ``mid`` (the
hottest 2 of 16 experts; even routing 12.5 %, the unbiased routers 19 %): S=0.5 26 %, S=1 42 %,
S=1.5 62 % (the law 25.6, 44.4, 63.8 %); about 15 s on 2 cores.

    python benchmark/offline/make_random_model.py --out-dir DIR \
        [--preset emulated|small|deepseek-v3|qwen3-30b-a3b-4l] \
        [--quantization fp8 | --fp8-copy FP8_DIR] [--expert-skew S]
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
from pathlib import Path

import torch
from make_tiny_models import (
    EOS_TOKEN,
    _write_json,
    build_tokenizer,
    deepseek_config,
    deepseek_shapes,
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
EMULATED = {
    "hidden_size": 1024,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 64,
    "intermediate_size": 256,
}
SMALL = {
    "hidden_size": 96,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "num_experts": 12,
    "num_experts_per_tok": 3,
    "moe_intermediate_size": 64,
    "intermediate_size": 256,
}
DEEPSEEK_V3 = {
    "hidden_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "kv_lora_rank": 512,
    "q_lora_rank": 128,
    "qk_nope_head_dim": 64,
    "qk_rope_head_dim": 64,
    "v_head_dim": 64,
    "n_routed_experts": 16,
    "num_experts_per_tok": 4,
    "n_group": 4,
    "topk_group": 2,
    "moe_intermediate_size": 128,
    "intermediate_size": 512,
}
QWEN3_30B_A3B_4L = {
    "hidden_size": 2048,
    "num_hidden_layers": 4,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 768,
    "intermediate_size": 6144,
    "vocab_size": 151936,
    "rope_theta": 1000000.0,
    "torch_dtype": "bfloat16",
}
QWEN3_MOE_PRESETS = {
    "mid": MID_SIZE,
    "emulated": EMULATED,
    "small": SMALL,
    "qwen3-30b-a3b-4l": QWEN3_30B_A3B_4L,
}
PRESETS = [*QWEN3_MOE_PRESETS, "deepseek-v3"]


def make_mid_size_model(
    out_dir: str, preset: str = "mid", quantization: str | None = None, expert_skew: float = 0.0
) -> str:
    """Writes ``preset`` to ``out_dir`` (kept if already there), stored as its config says or, with
    ``quantization="fp8"``, as a block-FP8 checkpoint; with ``expert_skew`` > 0 its routers skewed
    and the measured routing printed (of the unquantized weights). Returns ``out_dir``."""
    if expert_skew < 0 or not math.isfinite(expert_skew):
        raise ValueError(f"expert_skew must be a finite number >= 0, got {expert_skew}")
    out = Path(out_dir)
    if (out / "config.json").exists():
        return str(out)
    if quantization is None:
        _write_model(out, preset, expert_skew)
        return str(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as plain:  # beside out: same disk
        _write_model(Path(plain), preset, expert_skew)
        write_fp8_copy(plain, str(out))
    return str(out)


def write_fp8_copy(src_dir: str, dst_dir: str) -> str:
    """Writes ``dst_dir`` (kept if already there), the block-FP8 copy of the unquantized
    checkpoint ``src_dir`` in the published format: 128 × 128 blocks, the release's
    ``modules_to_not_convert``. Returns ``dst_dir``."""
    # Imported here: the plain path runs with only launch/ on the path.
    from benchmark.common.fp8_checkpoint import (
        published_modules_to_not_convert,
        quantize_checkpoint,
    )

    if (Path(dst_dir) / "config.json").exists():
        return dst_dir
    cfg = json.loads((Path(src_dir) / "config.json").read_text(encoding="utf-8"))
    skip = published_modules_to_not_convert(cfg)
    return quantize_checkpoint(src_dir, dst_dir, modules_to_not_convert=skip)


def _write_model(out: Path, preset: str, expert_skew: float) -> None:
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer()
    eos_id = tok.token_to_id(EOS_TOKEN)
    vocab_size = -(-tok.get_vocab_size() // 8) * 8
    if preset in QWEN3_MOE_PRESETS:
        cfg = qwen3_moe_config(vocab_size, eos_id) | QWEN3_MOE_PRESETS[preset]
        name, shapes = f"{preset}-qwen3-moe", qwen3_moe_shapes(cfg)
    else:
        cfg = deepseek_config(3, vocab_size, eos_id) | DEEPSEEK_V3
        name, shapes = preset, deepseek_shapes(cfg)
    tensors = make_tensors(name, shapes, unprintable_token_ids(tok, cfg["vocab_size"]))
    if cfg["torch_dtype"] != "float32":  # stored as the config says: bf16 halves 12 GB
        for key, t in tensors.items():  # one at a time: the float32 copies go as they come
            tensors[key] = t.to(getattr(torch, cfg["torch_dtype"]))
    if expert_skew:
        # Imported here: the plain path runs with only launch/ on the path.
        from benchmark.common.expert_skew import skew_routers

        # Its scratch copy of the checkpoint, inside out, is gone before config.json comes.
        skew_routers(tensors, cfg, expert_skew, name, scratch=out)
    save_tokenizer(tok, out)
    save_weights(tensors, out, num_shards=4)
    _write_json(out / "config.json", cfg)  # written last: its presence means complete
    if expert_skew:
        from benchmark.common.expert_skew import describe, measure_expert_shares

        del tensors  # the measurement loads its own copy
        shares = measure_expert_shares(str(out))
        print(describe(expert_skew, cfg["num_experts_per_tok"], shares), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", required=True)
    parser.add_argument("--preset", choices=PRESETS, default="mid")
    parser.add_argument("--quantization", choices=["fp8"], default=None)
    parser.add_argument(
        "--fp8-copy",
        metavar="DIR",
        help="also write DIR, a block-FP8 copy of the checkpoint, once it is complete",
    )
    parser.add_argument(
        "--expert-skew",
        type=float,
        default=0.0,
        metavar="S",
        help="skew every MoE router so that the expert of popularity rank r gets a share of the "
        "routed tokens proportional to 1/r**S (0, the default: unbiased routers); prints the "
        "measured share of the hottest 10 %% of experts (mid: 42 %% at S=1, 19 %% at S=0)",
    )
    args = parser.parse_args()
    if args.fp8_copy and args.quantization:
        parser.error("--fp8-copy copies an unquantized checkpoint: drop --quantization")
    if args.expert_skew < 0 or not math.isfinite(args.expert_skew):
        parser.error(f"--expert-skew must be a finite number >= 0, got {args.expert_skew}")
    print(make_mid_size_model(args.out_dir, args.preset, args.quantization, args.expert_skew))
    if args.fp8_copy:
        print(write_fp8_copy(args.out_dir, args.fp8_copy))


if __name__ == "__main__":
    main()
