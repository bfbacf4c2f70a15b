"""The server entry points run in foreign interpreters (the keeper in any Python, ``evaluators.vllm.serve`` in the
vllm environment, the ExLlamaV2 app in the exl2 one): importing them loads nothing of the core beyond what a
runner may load, and neither pydantic nor gguf."""

from __future__ import annotations

import pytest

from tests.test_architecture import RUNNER_PIPELINE, RUNNER_SHARED, _loaded_after


@pytest.mark.parametrize("module", ["evaluators.serving.keeper", "evaluators.vllm.serve",
                                    "evaluators.exllamav2.openai_server"])
def test_entry_points_load_only_what_a_runner_may(module: str) -> None:
    own = {module, module.rpartition(".")[0], f"{module.rpartition('.')[0]}.runner"}
    bad = [m for m in _loaded_after(module) if not (m in own or m in RUNNER_SHARED or m in RUNNER_PIPELINE)]
    assert not bad, f"{module} loads {bad}"
