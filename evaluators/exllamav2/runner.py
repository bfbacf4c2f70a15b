"""ExLlamaV2 runner (CUDA only; runs in the ExLlamaV2 interpreter): log-probs on the shared windows,
then speed.

Quality: each window is one ``model.forward`` without a cache (or with a fresh cache when the
window is longer than ExLlamaV2's ``max_input_len``); the logits of every position feed the shared
Collector, exactly as for every other engine.

Speed (when asked), greedy decoding on prompts cut from the window ids, with the definitions of
``evaluators/speed.py`` computed from timestamps the runner records (after ``torch.cuda.synchronize``):

* batch 1 on a ``prompt_tokens`` prompt: the prompt's forward gives the first token, then ``gen_tokens − 1``
  decode steps: time to first token, prompt tok/s, decode tok/s;
* N concurrent sequences for each N in ``parallel``, N different ``parallel_prompt_tokens`` prompts
  enqueued together: ExLlamaV2's dynamic generator (paged attention, which needs flash-attn), each job's
  first and last token timed as the generator streams them: aggregate generated tok/s, end to end. Where
  paged attention is unavailable the runner says so and times a batched forward with an N-row cache
  instead, prefill included (``tool`` names which one was measured).

Each is repeated ``repeats`` times; the result records the shape and the engine settings (FP16 cache,
no CUDA graphs, flash-attn availability). Imports only ``evaluators.protocol``, ``evaluators.speed``,
numpy, torch and exllamav2.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from evaluators.protocol import (
    Collector,
    Timer,
    hardware,
    load_windows,
    read_request,
    write_result,
)
from evaluators.speed import Seq, engine_settings, prompts, speed_result


def _load(req: dict[str, Any], max_seq_len: int) -> tuple[Any, Any, Any]:
    from exllamav2 import ExLlamaV2, ExLlamaV2Config, ExLlamaV2Tokenizer

    config = ExLlamaV2Config(req["model"])
    config.max_seq_len = max(max_seq_len, 256)
    model = ExLlamaV2(config)
    model.load()
    return config, model, ExLlamaV2Tokenizer(config)


def _quality(req: dict[str, Any], config: Any, model: Any, out_dir: Path) -> dict[str, Any]:
    import torch
    from exllamav2 import ExLlamaV2Cache

    ids, starts = load_windows(req["windows"])
    window = ids.shape[1]
    cache = ExLlamaV2Cache(model, max_seq_len=window) if window > config.max_input_len else None
    col = Collector.from_request(req)
    with Timer() as t, torch.inference_mode():
        for k in range(ids.shape[0]):
            if cache is not None:
                cache.current_seq_len = 0
            logits = model.forward(torch.as_tensor(ids[k:k + 1]), cache)
            # ExLlamaV2 pads the head's width to a multiple of 32; padded columns are not tokens
            col.add_window(logits[0, :, :config.vocab_size].float().cpu().numpy(), ids[k], int(starts[k]))
    n = col.save(out_dir)
    return {"n_positions": n, "eval_s": t.s, "eval_tok_per_s": ids.size / t.s}


def _sync() -> None:
    import torch

    torch.cuda.synchronize()


def _single_stream(model: Any, prompt: list[int], gen: int, repeats: int) -> list[Seq]:
    """Batch 1, ``repeats`` times: the prompt's forward gives the first token, then ``gen − 1`` decode steps."""
    import torch
    from exllamav2 import ExLlamaV2Cache

    cache = ExLlamaV2Cache(model, max_seq_len=len(prompt) + gen + 8, batch_size=1)
    ids = torch.tensor([prompt], dtype=torch.long)
    runs = []
    with torch.inference_mode():
        cache.current_seq_len = 0
        model.forward(ids[:, :16], cache, last_id_only=True)  # warm-up: kernels, autotune
        for _ in range(repeats):
            cache.current_seq_len = 0
            _sync()
            t_submit = time.perf_counter()
            logits = model.forward(ids, cache, last_id_only=True)
            tok = int(torch.argmax(logits[0, -1]))  # .item() synchronizes
            t_first = time.perf_counter()
            for _ in range(gen - 1):
                logits = model.forward(torch.tensor([[tok]]), cache, last_id_only=True)
                tok = int(torch.argmax(logits[0, -1]))
            runs.append(Seq(t_submit, t_first, time.perf_counter(), len(prompt), gen))
    return runs


def _dynamic(model: Any, tokenizer: Any, prompts_: list[list[int]], gen: int, repeats: int) -> list[list[Seq]]:
    """``repeats`` runs of ``len(prompts_)`` concurrent greedy jobs in the dynamic generator (one warm-up run
    first), each job's first and last token timed as the generator streams them."""
    import torch
    from exllamav2 import ExLlamaV2Cache
    from exllamav2.generator import ExLlamaV2DynamicGenerator, ExLlamaV2DynamicJob, ExLlamaV2Sampler

    n, p = len(prompts_), len(prompts_[0])
    pages = -(-n * (p + gen + 16) // 256) * 256
    cache = ExLlamaV2Cache(model, max_seq_len=pages, batch_size=1)
    generator = ExLlamaV2DynamicGenerator(model=model, cache=cache, tokenizer=tokenizer, max_batch_size=n,
                                          paged=True)

    def run() -> list[Seq]:
        first: dict[int, float] = {}
        last: dict[int, float] = {}
        count = dict.fromkeys(range(n), 0)
        _sync()
        t_submit = time.perf_counter()
        for i, prompt in enumerate(prompts_):
            generator.enqueue(ExLlamaV2DynamicJob(input_ids=torch.tensor([prompt]), max_new_tokens=gen,
                                                  min_new_tokens=gen, stop_conditions=[],
                                                  gen_settings=ExLlamaV2Sampler.Settings.greedy(), identifier=i))
        while generator.num_remaining_jobs():
            results = generator.iterate()  # returns after the step's tokens are on the host
            now = time.perf_counter()
            for r in results:
                if r["stage"] != "streaming":
                    continue
                i, new = r["identifier"], int(r["token_ids"].shape[-1]) if "token_ids" in r else 0
                if new and i not in first:
                    first[i] = now
                count[i] += new
                if r.get("eos"):
                    last[i] = now
        return [Seq(t_submit, first[i], last[i], p, count[i]) for i in range(n)]

    run()  # warm-up
    return [run() for _ in range(repeats)]


def _batched_forward(model: Any, prompts_: list[list[int]], gen: int, repeats: int) -> list[list[Seq]]:
    """Fallback without paged attention, ``repeats`` times: prefill the N prompts as one batch (each row's
    first token), then ``gen − 1`` batched decode steps."""
    import torch
    from exllamav2 import ExLlamaV2Cache

    n, p = len(prompts_), len(prompts_[0])
    cache = ExLlamaV2Cache(model, max_seq_len=p + gen + 8, batch_size=n)
    ids = torch.tensor(prompts_, dtype=torch.long)
    runs = []
    with torch.inference_mode():
        for _ in range(repeats):
            cache.current_seq_len = 0
            _sync()
            t_submit = time.perf_counter()
            logits = model.forward(ids, cache, last_id_only=True)
            toks = torch.argmax(logits[:, -1], dim=-1, keepdim=True).cpu()
            t_first = time.perf_counter()
            for _ in range(gen - 1):
                logits = model.forward(toks, cache, last_id_only=True)
                toks = torch.argmax(logits[:, -1], dim=-1, keepdim=True).cpu()
            t_last = time.perf_counter()
            runs.append([Seq(t_submit, t_first, t_last, p, gen) for _ in range(n)])
    return runs


def _parallel(model: Any, tokenizer: Any, pool: np.ndarray,
              speed: dict[str, Any]) -> tuple[dict[int, list[list[Seq]]], str]:
    """N concurrent sequences for each N in ``speed["parallel"]`` (the dynamic generator, or the batched
    fallback once it fails); returns the runs and the ``tool`` that was timed."""
    p, gen, repeats = int(speed["parallel_prompt_tokens"]), int(speed["parallel_gen_tokens"]), int(speed["repeats"])
    runs: dict[int, list[list[Seq]]] = {}
    tool = "exllamav2 dynamic generator"
    for n in (int(x) for x in speed["parallel"]):
        batch = prompts(pool, n, p)
        try:
            runs[n] = _dynamic(model, tokenizer, batch, gen, repeats) if tool.endswith("generator") \
                else _batched_forward(model, batch, gen, repeats)
        except (AssertionError, ImportError, RuntimeError) as exc:
            if not tool.endswith("generator"):
                raise
            tool = f"batched model.forward (dynamic generator unavailable: {type(exc).__name__}: {exc})"
            runs[n] = _batched_forward(model, batch, gen, repeats)
    return runs, tool


def _settings(config: Any, req: dict[str, Any]) -> dict[str, Any]:
    """The engine settings a speed result records (evaluators.speed.engine_settings)."""
    import importlib.util

    import torch

    flash = "installed" if importlib.util.find_spec("flash_attn") else "not installed (no paged attention)"
    return engine_settings(dtype="float16 activations; EXL2 weights", kernel=f"exllamav2 CUDA extension; "
                           f"flash-attn {flash}; {torch.cuda.get_device_name(0)}",
                           cuda_graphs="not used (ExLlamaV2 runs its forward eagerly)",
                           kv_cache={"type": "ExLlamaV2Cache (FP16)", "max_seq_len": config.max_seq_len,
                                     "parallel": "paged (dynamic generator, 256-token pages) or one row per sequence"},
                           threads=req.get("threads"))


def measure_speed(model: Any, tokenizer: Any, config: Any, pool: np.ndarray, req: dict[str, Any]) -> dict[str, Any]:
    """The speed result (evaluators.speed.speed_result) for the request's ``speed`` shape."""
    s = req["speed"]
    (prompt,) = prompts(pool, 1, int(s["prompt_tokens"]))
    single = _single_stream(model, prompt, int(s["gen_tokens"]), int(s["repeats"]))
    parallel, tool = _parallel(model, tokenizer, pool, s) if s.get("parallel") else ({}, "")
    result = speed_result(s, single, parallel, _settings(config, req), tool="exllamav2 model.forward")
    if parallel:
        result["parallel"]["tool"] = tool
    return result


def main() -> None:
    req = read_request()
    out_dir = Path(req["out_dir"])
    out_dir.mkdir(parents=True, exist_ok=True)
    import exllamav2
    import torch

    speed = req.get("speed")
    ids, _ = load_windows(req["windows"])
    need = ids.shape[1]
    if speed:
        need = max(need, speed["prompt_tokens"] + speed["gen_tokens"] + 16,
                   speed["parallel_prompt_tokens"] + speed["parallel_gen_tokens"] + 16)
    config, model, tokenizer = _load(req, need)
    result: dict[str, Any] = {
        "engine": "exllamav2",
        "engine_version": f"exllamav2 {exllamav2.__version__}, torch {torch.__version__}, CUDA {torch.version.cuda}",
        "hardware": hardware(req.get("threads"))}
    result["quality"] = _quality(req, config, model, out_dir)
    if speed:
        result["speed"] = measure_speed(model, tokenizer, config, ids, req)
    write_result(out_dir, result)
    sys.stdout.flush()
    os._exit(0)  # exllamav2's extension may tear down noisily at interpreter exit; the result is written


if __name__ == "__main__":
    np.seterr(all="ignore")
    main()
