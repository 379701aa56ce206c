"""``bench_one_batch.py --compare-hf`` and the GPU report's last table: the same static batch
through HF transformers (a forward for the prefill, ``generate`` for the whole), on the model's
device, timed alike."""

from __future__ import annotations

import time

import torch

from srt.server_args import ServerArgs


def load_hf_model(server_args: ServerArgs, runner):
    """HF transformers' model of the same checkpoint, on the runner's device and dtype."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        server_args.model_path, dtype=runner.model_config.dtype
    )
    return model.to(runner.device).eval()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def hf_run(model, input_ids: list[list[int]], output_len: int) -> dict:
    ids = torch.tensor(input_ids, device=model.device)
    with torch.no_grad():
        start = time.perf_counter()
        model(ids)
        _sync(ids.device)
        prefill = time.perf_counter() - start
        start = time.perf_counter()
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=output_len,
            min_new_tokens=output_len,
            pad_token_id=0,
        )
        _sync(ids.device)
        total = time.perf_counter() - start
    return {
        "prefill_latency": prefill,
        "total_latency": total,
        "output_ids": out[:, ids.shape[1] :].tolist(),
    }


def compare_with_hf(hf_model, inputs: list[list[int]], output_len: int, ours: dict) -> dict:
    """Runs ``inputs`` through ``hf_model`` (after a warm-up), prints and returns the speed-ups
    of ``ours`` (``run_once``'s result) and how many greedy outputs are identical."""
    hf_run(hf_model, [inputs[0][:8]], 2)  # warm-up
    ref = hf_run(hf_model, inputs, output_len)
    same = sum(a == b for a, b in zip(ours["output_ids"], ref["output_ids"]))
    prefill_x = ref["prefill_latency"] / ours["prefill_latency"]
    total_x = ref["total_latency"] / ours["total_latency"]
    print(
        f"HF transformers. prefill latency: {ref['prefill_latency']:6.5f} s, "
        f"generate latency: {ref['total_latency']:6.3f} s"
    )
    print(
        f"srt vs HF: prefill {prefill_x:5.2f}x, total {total_x:5.2f}x faster; "
        f"greedy outputs identical for {same}/{len(inputs)} sequences"
    )
    return {
        "hf_prefill_latency": ref["prefill_latency"],
        "hf_total_latency": ref["total_latency"],
        "prefill_speedup_vs_hf": prefill_x,
        "total_speedup_vs_hf": total_x,
        "num_identical_outputs": same,
    }
