"""Run the pinned llama.cpp ``convert_hf_to_gguf.py``, told what it must know to read a checkpoint as transformers does.

Usage: ``python -m converters.gguf.workers.hf_to_gguf CONVERTER OVERRIDES_JSON ARG...``: CONVERTER is the script's
path, OVERRIDES_JSON ``{"hparams": {...}, "skip_suffixes": [...]}`` (either may be absent), ARG... the script's own
arguments.

The script reads a checkpoint's hyperparameters as ``AutoConfig.from_pretrained(folder).to_dict()``, with the
transformers of the environment it runs in (the core's, transformers 5), and some of its model classes index keys
that transformers 5's config classes no longer keep under those names, or read a key that transformers' model
code overrides: GPT-NeoX's ``rotary_pct`` (moved into ``rope_parameters`` as the config loads, so every GPT-NeoX
checkpoint, Pythia's included, stops on ``KeyError: 'rotary_pct'``), GPT-2's ``n_ctx`` (not written by
transformers 5's ``save_pretrained``), multi-query Falcon's ``num_kv_heads`` (the config holds the head count;
the model uses one). This worker wraps ``ModelBase.load_hparams`` so that the ``hparams`` replace or add to the
loaded hyperparameters, and ``TextModel.filter_tensors`` (the script's own hook for dropping a tensor, which every
model class's override ends in) so that tensors named with a ``skip_suffixes`` ending are dropped (GPT-2's
causal-mask buffers, which transformers ignores as it loads and the script cannot map), then runs the script as
``__main__``, in this process: its output, log and exit status are the script's.
converters/gguf/converter.py's ``converter_overrides`` decides what to give (each as transformers reads the
checkpoint) and runs the script directly when it is nothing.
"""

from __future__ import annotations

import json
import runpy
import sys
from typing import Any


def main(argv: list[str]) -> None:
    converter, overrides_json, *args = argv
    overrides: dict[str, Any] = json.loads(overrides_json)
    supplied: dict[str, Any] = overrides.get("hparams") or {}
    skip = tuple(overrides.get("skip_suffixes") or ())
    from conversion.base import ModelBase, TextModel  # type: ignore[import-not-found]  # the script's package

    load = ModelBase.load_hparams

    def load_hparams(*args: Any, **kwargs: Any) -> Any:
        hparams = load(*args, **kwargs)
        if isinstance(hparams, dict):
            hparams = {**hparams, **supplied}
        return hparams

    ModelBase.load_hparams = staticmethod(load_hparams)
    if skip:
        keep = TextModel.filter_tensors.__func__

        def filter_tensors(cls: Any, item: tuple[str, Any]) -> Any:
            return None if item[0].endswith(skip) else keep(cls, item)

        TextModel.filter_tensors = classmethod(filter_tensors)
    sys.argv = [converter, *args]
    runpy.run_path(converter, run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
