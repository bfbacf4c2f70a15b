"""The transformers runner's record of where the weights ran (``quality.devices``): one naming for both of its
sources, accelerate's ``hf_device_map`` (a GPU as a bare index) and the parameters' own devices (``cuda:0``).
On an H200 with transformers 5.17, ``device_map="auto"`` on one GPU left ``hf_device_map`` unset and the run
recorded ``cuda:0`` where a multi-GPU run would have recorded ``0`` (tests/evaluators/test_reference_gpu.py)."""

from __future__ import annotations

import torch

from evaluators.transformers.runner import device_name, placement


def test_device_names_are_torchs() -> None:
    assert [device_name(d) for d in (0, "1", "cuda:0", torch.device("cpu"), "disk")] == \
        ["cuda:0", "cuda:1", "cuda:0", "cpu", "disk"]


def test_placement_names_devices_alike_from_either_source() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    assert placement(model) == ["cpu"]
    model.hf_device_map = {"0": 0, "1": 1, "2": "cpu", "3": 0}  # as accelerate's dispatch sets it
    assert placement(model) == ["cuda:0", "cuda:1", "cpu"]
