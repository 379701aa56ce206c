"""Write deterministic tiny HF-format MoE checkpoints for tests (no downloads).

Three models share one byte-level BPE tokenizer trained here on an embedded corpus:
  tiny-qwen3-moe    Qwen3MoeForCausalLM, GQA, q/k norms, 2 safetensors shards + index
  tiny-deepseek-v2  DeepseekV2ForCausalLM, MLA without q_lora, softmax group_limited_greedy top-3
  tiny-deepseek-v3  DeepseekV3ForCausalLM, MLA with q_lora, sigmoid noaux_tc top-2, YaRN rope
Tensors use the per-expert names of the released checkpoints and are stored as float32. Every
file is byte-identical across reruns: fixed seeds per model, sorted JSON, fixed tensor order.

    python launch/make_tiny_models.py --out-dir DIR [--only NAME ...]
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
import shutil
import zlib
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

EOS_TOKEN = "<|endoftext|>"
SPECIAL_TOKENS = [EOS_TOKEN, "<|im_start|>", "<|im_end|>"]
VOCAB_SIZE = 512  # 256 byte tokens + merges + the special tokens, appended last
MAX_POSITIONS = 2048
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
CORPUS = """\
The quick brown fox jumps over the lazy dog while the farmer watches from the old wooden gate.
A small boat drifted slowly across the quiet lake as the sun went down behind the hills.
Scientists measured the temperature of the ocean every morning for three hundred days.
She opened the window, took a deep breath, and listened to the birds singing in the garden.
The train to the city leaves at seven o'clock, so please do not be late for it tomorrow.
My grandmother baked bread every Sunday, and the whole house smelled warm and sweet.
In the beginning the universe was small, hot and dense, and then it expanded very quickly.
Water boils at one hundred degrees Celsius at sea level, but at a lower temperature on a mountain.
The children played football in the park until it started to rain, then they ran home laughing.
Computers store numbers in binary, using only the digits zero and one to represent everything.
He wrote a long letter to his friend, folded it twice, and sealed it in a blue envelope.
The museum was full of paintings, sculptures and ancient maps of forgotten kingdoms.
Every language has its own rules for grammar, spelling and the order of words in a sentence.
The doctor told him to drink more water, sleep eight hours a night, and walk every day.
Large language models predict the next token given the tokens that came before it.
A mixture of experts routes each token to a few experts chosen by a learned gate.
The server receives a request, schedules the batch, runs the model and returns the text.
Mountains rise above the clouds, rivers carve deep valleys, and forests cover the plains.
On Monday we will review the plan; on Tuesday we will start building; on Friday we will test.
What is the capital of France? The capital of France is Paris, a city on the river Seine.
How many legs does a spider have? A spider has eight legs, while an insect has only six.
Why is the sky blue? Sunlight is scattered by the air, and blue light is scattered the most.
Once upon a time there lived a king who had three daughters and a very clever cat.
The library opens at nine in the morning and closes at six in the evening, except on holidays.
Please add two cups of flour, one egg, a pinch of salt and a little milk, then stir well.
The robot picked up the red block, placed it on the green block, and waited for instructions.
Stars are born in clouds of gas and dust, shine for billions of years, and then fade away.
The market was busy with people buying apples, oranges, bananas, fish, cheese and bread.
Good software is tested often, written clearly, and changed in small careful steps.
If you multiply six by seven you get forty-two, and if you add ten you get fifty-two.
The weather today is cloudy with a chance of rain in the afternoon and wind in the evening.
They walked along the beach collecting shells, talking about their plans for the summer.
The first chapter introduces the characters; the second chapter describes their journey.
Light travels faster than sound, which is why we see lightning before we hear the thunder.
An apple a day keeps the doctor away, or so the old saying goes in many English homes.
The engineer fixed the bridge, painted the railings, and opened the road again on Thursday.
Music can make people happy, calm or sad, and every culture in the world has its own songs.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 100 256 512 1024 2048 3.14 2.718 -1 +1 = 42.
Code: def add(a, b): return a + b  # for i in range(10): print(i * i)  {"key": [1, 2, 3]}
Hello! Hi there. Thanks, bye. Yes or no? Maybe... (perhaps) [never] <always> 'quoted' "text".
"""


def build_tokenizer(extra_lines: Sequence[str] = (), split_digits: bool = False) -> Tokenizer:
    """Byte-level BPE trained on CORPUS (and ``extra_lines``); special tokens take the last
    ids. ``split_digits``: every digit its own pre-token, so no merge spans two digits."""
    tok = Tokenizer(models.BPE())
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if split_digits:
        digits = pre_tokenizers.Digits(individual_digits=True)
        tok.pre_tokenizer = pre_tokenizers.Sequence([digits, byte_level])
    else:
        tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE - len(SPECIAL_TOKENS),
        min_frequency=1,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator([*CORPUS.splitlines(keepends=True), *extra_lines], trainer=trainer)
    tok.add_special_tokens(SPECIAL_TOKENS)
    return tok


def save_tokenizer(tok: Tokenizer, out: Path) -> None:
    tok.save(str(out / "tokenizer.json"))
    added = {
        str(tok.token_to_id(t)): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for t in SPECIAL_TOKENS
    }
    _write_json(
        out / "tokenizer_config.json",
        {
            "added_tokens_decoder": added,
            "additional_special_tokens": SPECIAL_TOKENS[1:],
            "bos_token": None,
            "chat_template": CHAT_TEMPLATE,
            "clean_up_tokenization_spaces": False,
            "eos_token": EOS_TOKEN,
            "model_max_length": MAX_POSITIONS,
            "pad_token": EOS_TOKEN,
            "tokenizer_class": "PreTrainedTokenizerFast",
        },
    )
    _write_json(
        out / "special_tokens_map.json",
        {
            "additional_special_tokens": SPECIAL_TOKENS[1:],
            "eos_token": EOS_TOKEN,
            "pad_token": EOS_TOKEN,
        },
    )


def _common_config(vocab_size: int, eos_id: int) -> dict:
    # Like Qwen's releases: config bos = eos = <|endoftext|>; the tokenizer adds no bos.
    return {
        "bos_token_id": eos_id,
        "eos_token_id": eos_id,
        "pad_token_id": eos_id,
        "hidden_act": "silu",
        "hidden_size": 64,
        "initializer_range": 0.02,
        "max_position_embeddings": MAX_POSITIONS,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "use_cache": True,
        "vocab_size": vocab_size,
    }


def qwen3_moe_config(vocab_size: int, eos_id: int) -> dict:
    return _common_config(vocab_size, eos_id) | {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "attention_bias": False,
        "decoder_sparse_step": 1,
        "head_dim": 32,  # heads * head_dim != hidden_size, as in the released Qwen3-MoE models
        "intermediate_size": 128,
        "mlp_only_layers": [],
        "moe_intermediate_size": 32,
        "norm_topk_prob": True,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "num_key_value_heads": 2,
        "use_sliding_window": False,
    }


def deepseek_config(version: int, vocab_size: int, eos_id: int) -> dict:
    cfg = _common_config(vocab_size, eos_id) | {
        "architectures": [f"DeepseekV{version}ForCausalLM"],
        "model_type": f"deepseek_v{version}",
        "attention_bias": False,
        "first_k_dense_replace": 1,
        "intermediate_size": 128,
        "kv_lora_rank": 32,
        "moe_intermediate_size": 32,
        "moe_layer_freq": 1,
        "n_group": 4,
        "n_routed_experts": 8,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "num_key_value_heads": 4,
        "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8,
        "topk_group": 2,
        "v_head_dim": 16,
    }
    if version == 2:
        # top-3 of 2 groups (real V2: top-6 of 3 groups): with top_k <= topk_group the group limit
        # (group score = max) never changes the choice, so it would go untested.
        return cfg | {
            "norm_topk_prob": False,
            "num_experts_per_tok": 3,
            "q_lora_rank": None,
            "routed_scaling_factor": 1.0,
            "scoring_func": "softmax",
            "topk_method": "group_limited_greedy",
        }
    return cfg | {
        "norm_topk_prob": True,
        "num_nextn_predict_layers": 0,
        "q_lora_rank": 24,
        "rope_scaling": {
            "beta_fast": 32,
            "beta_slow": 1,
            "factor": 4.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "original_max_position_embeddings": MAX_POSITIONS // 4,
            "type": "yarn",
        },
        "routed_scaling_factor": 2.5,
        "scoring_func": "sigmoid",
        "topk_method": "noaux_tc",
    }


def _mlp_shapes(prefix: str, hidden: int, inter: int) -> list[tuple[str, tuple[int, ...]]]:
    return [
        (f"{prefix}.gate_proj.weight", (inter, hidden)),
        (f"{prefix}.up_proj.weight", (inter, hidden)),
        (f"{prefix}.down_proj.weight", (hidden, inter)),
    ]


def _moe_shapes(prefix: str, cfg: dict, num_experts: int) -> list[tuple[str, tuple[int, ...]]]:
    hidden, inter = cfg["hidden_size"], cfg["moe_intermediate_size"]
    shapes = [(f"{prefix}.gate.weight", (num_experts, hidden))]
    for e in range(num_experts):
        shapes += _mlp_shapes(f"{prefix}.experts.{e}", hidden, inter)
    return shapes


def qwen3_moe_shapes(cfg: dict) -> list[tuple[str, tuple[int, ...]]]:
    h, hd = cfg["hidden_size"], cfg["head_dim"]
    nq, nkv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    shapes = [("model.embed_tokens.weight", (cfg["vocab_size"], h))]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}"
        shapes += [
            (f"{p}.input_layernorm.weight", (h,)),
            (f"{p}.self_attn.q_proj.weight", (nq, h)),
            (f"{p}.self_attn.k_proj.weight", (nkv, h)),
            (f"{p}.self_attn.v_proj.weight", (nkv, h)),
            (f"{p}.self_attn.o_proj.weight", (h, nq)),
            (f"{p}.self_attn.q_norm.weight", (hd,)),
            (f"{p}.self_attn.k_norm.weight", (hd,)),
            (f"{p}.post_attention_layernorm.weight", (h,)),
        ]
        shapes += _moe_shapes(f"{p}.mlp", cfg, cfg["num_experts"])
    return shapes + [("model.norm.weight", (h,)), ("lm_head.weight", (cfg["vocab_size"], h))]


def _mla_shapes(p: str, cfg: dict) -> list[tuple[str, tuple[int, ...]]]:
    h, heads, kv_rank = cfg["hidden_size"], cfg["num_attention_heads"], cfg["kv_lora_rank"]
    qk_dim = cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]
    q_rank = cfg["q_lora_rank"]
    if q_rank is None:
        shapes = [(f"{p}.q_proj.weight", (heads * qk_dim, h))]
    else:
        shapes = [
            (f"{p}.q_a_proj.weight", (q_rank, h)),
            (f"{p}.q_a_layernorm.weight", (q_rank,)),
            (f"{p}.q_b_proj.weight", (heads * qk_dim, q_rank)),
        ]
    kv_b_out = heads * (cfg["qk_nope_head_dim"] + cfg["v_head_dim"])
    return shapes + [
        (f"{p}.kv_a_proj_with_mqa.weight", (kv_rank + cfg["qk_rope_head_dim"], h)),
        (f"{p}.kv_a_layernorm.weight", (kv_rank,)),
        (f"{p}.kv_b_proj.weight", (kv_b_out, kv_rank)),
        (f"{p}.o_proj.weight", (h, heads * cfg["v_head_dim"])),
    ]


def deepseek_shapes(cfg: dict) -> list[tuple[str, tuple[int, ...]]]:
    h, experts = cfg["hidden_size"], cfg["n_routed_experts"]
    shapes = [("model.embed_tokens.weight", (cfg["vocab_size"], h))]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}"
        shapes += [(f"{p}.input_layernorm.weight", (h,))]
        shapes += _mla_shapes(f"{p}.self_attn", cfg)
        shapes += [(f"{p}.post_attention_layernorm.weight", (h,))]
        if i < cfg["first_k_dense_replace"]:
            shapes += _mlp_shapes(f"{p}.mlp", h, cfg["intermediate_size"])
            continue
        shapes += _moe_shapes(f"{p}.mlp", cfg, experts)
        if cfg["topk_method"] == "noaux_tc":
            shapes += [(f"{p}.mlp.gate.e_score_correction_bias", (experts,))]
        shared = cfg["moe_intermediate_size"] * cfg["n_shared_experts"]
        shapes += _mlp_shapes(f"{p}.mlp.shared_experts", h, shared)
    return shapes + [("model.norm.weight", (h,)), ("lm_head.weight", (cfg["vocab_size"], h))]


def init_tensor(name: str, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """Random weights scaled so activations stay O(1) and logits are far from uniform."""
    x = torch.randn(shape, generator=gen, dtype=torch.float32)
    if name.endswith("norm.weight"):
        return 1.0 + 0.1 * x  # not all ones, so a skipped or misplaced norm changes the output
    if name.endswith("e_score_correction_bias"):
        return 0.05 * x  # large enough to change some expert choices
    if name == "model.embed_tokens.weight":
        return x
    scale = 1.0  # std 1/sqrt(fan_in); routers and lm_head sharper to avoid near-ties
    if name.endswith("mlp.gate.weight"):
        scale = 2.0
    elif name == "lm_head.weight":
        scale = 3.0
    return x * (scale / shape[-1] ** 0.5)


def unprintable_token_ids(tok: Tokenizer, vocab_size: int) -> list[int]:
    """Lone non-ASCII / control bytes, chat markers and padding rows past the tokenizer."""
    ids = [tok.token_to_id(t) for t in SPECIAL_TOKENS[1:]]
    for i in range(tok.get_vocab_size()):
        text = tok.decode([i], skip_special_tokens=False)
        if not all(c == "\n" or (c.isascii() and c.isprintable()) for c in text):
            ids.append(i)
    return sorted(ids + list(range(tok.get_vocab_size(), vocab_size)))


def make_tensors(
    name: str, shapes: list[tuple[str, tuple[int, ...]]], quiet_ids: list[int]
) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))  # independent of --only
    tensors = {key: init_tensor(key, shape, gen) for key, shape in shapes}
    # Shrink their lm_head rows so greedy text stays printable (no broken UTF-8 in string tests).
    tensors["lm_head.weight"][quiet_ids] *= 0.1
    return tensors


def save_weights(tensors: dict[str, torch.Tensor], out: Path, num_shards: int) -> None:
    keys = list(tensors)
    if num_shards == 1:
        save_file({k: tensors[k] for k in keys}, str(out / "model.safetensors"), {"format": "pt"})
        return
    per_shard = -(-len(keys) // num_shards)
    weight_map = {}
    for s in range(num_shards):
        fname = f"model-{s + 1:05d}-of-{num_shards:05d}.safetensors"
        shard = {k: tensors[k] for k in keys[s * per_shard : (s + 1) * per_shard]}
        save_file(shard, str(out / fname), {"format": "pt"})
        weight_map |= dict.fromkeys(shard, fname)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    _write_json(out / "model.safetensors.index.json", index)


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", encoding="utf-8")


ConfigFn = Callable[[int, int], dict]
MODELS: dict[str, tuple[ConfigFn, Callable[[dict], list], int]] = {
    "tiny-qwen3-moe": (qwen3_moe_config, qwen3_moe_shapes, 2),
    "tiny-deepseek-v2": (lambda v, e: deepseek_config(2, v, e), deepseek_shapes, 1),
    "tiny-deepseek-v3": (lambda v, e: deepseek_config(3, v, e), deepseek_shapes, 1),
}
MODEL_NAMES = list(MODELS)


def make_tiny_models(out_dir: str, names: list[str] | None = None) -> dict[str, str]:
    """Write the named models (default: all) under out_dir; returns name -> model directory."""
    names = MODEL_NAMES if names is None else names
    unknown = sorted(set(names) - set(MODELS))
    if unknown:
        raise ValueError(f"unknown tiny models {unknown}; choose from {MODEL_NAMES}")
    tok = build_tokenizer()
    eos_id = tok.token_to_id(EOS_TOKEN)
    vocab_size = -(-tok.get_vocab_size() // 8) * 8
    quiet_ids = unprintable_token_ids(tok, vocab_size)
    paths = {}
    for name in names:
        config_fn, shapes_fn, num_shards = MODELS[name]
        out = Path(out_dir) / name
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        cfg = config_fn(vocab_size, eos_id)
        _write_json(out / "config.json", cfg)
        gen_cfg = {"bos_token_id": eos_id, "eos_token_id": eos_id, "pad_token_id": eos_id}
        _write_json(out / "generation_config.json", gen_cfg)
        save_tokenizer(tok, out)
        save_weights(make_tensors(name, shapes_fn(cfg), quiet_ids), out, num_shards)
        paths[name] = str(out)
    return paths


def default_root() -> Path:
    """``$SRT_TINY_MODEL_DIR`` or ``<repo>/.cache/tiny-models``."""
    env = os.environ.get("SRT_TINY_MODEL_DIR")
    return Path(env) if env else Path(__file__).resolve().parent.parent / ".cache" / "tiny-models"


def ensure_tiny_models(root: Path | None = None) -> dict[str, str]:
    """Build all tiny models into root unless a finished build of this generator is there.

    The marker holds the generator's hash and is written last, so a half-written or stale
    directory is rebuilt; a file lock lets concurrent processes share one build.
    """
    root = root or default_root()
    root.mkdir(parents=True, exist_ok=True)
    marker = root / ".complete"
    version = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()
    with open(root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not marker.exists() or marker.read_text() != version:
            marker.unlink(missing_ok=True)
            make_tiny_models(str(root))
            marker.write_text(version)
    return {name: str(root / name) for name in MODEL_NAMES}


BUNDLED_MODELS_DIR = Path(__file__).resolve().parent / "models"
BUNDLED_MODELS = ("arith-qwen3-moe", "arith-deepseek-v3")  # launch/train_tiny_models.py


def bundled_model_path(name: str = BUNDLED_MODELS[0]) -> str:
    """A trained checkpoint committed with the project (it answers arithmetic)."""
    if name not in BUNDLED_MODELS:
        raise ValueError(f"unknown bundled model {name!r}; choose from {BUNDLED_MODELS}")
    return str(BUNDLED_MODELS_DIR / name)


def default_model_path() -> str:
    """The model ``python -m launch_server`` and the benchmarks serve without ``--model-path``:
    the bundled Qwen3-MoE trained on arithmetic."""
    return bundled_model_path()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", required=True)
    parser.add_argument("--only", nargs="+", choices=MODEL_NAMES, default=None)
    args = parser.parse_args()
    for name, path in make_tiny_models(args.out_dir, args.only).items():
        print(f"{name}: {path}")


if __name__ == "__main__":
    main()
