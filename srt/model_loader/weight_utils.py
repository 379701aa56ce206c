"""Checkpoint iteration: the safetensors files of a model directory and their tensors."""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Iterator

import torch
from safetensors import safe_open


def safetensors_files(model_dir: str) -> list[str]:
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(model_dir, n) for n in names]
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {model_dir}")
    return files


def iterate_safetensors(model_dir: str) -> Iterator[tuple[str, torch.Tensor]]:
    for path in safetensors_files(model_dir):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)
