"""ExLlamaV2 runner (CUDA only; runs in the ExLlamaV2 interpreter): log-probs on the shared windows,
then speed.

Quality: each window is one ``model.forward`` without a cache (or with a fresh cache when the
window is longer than ExLlamaV2's ``max_input_len``); the logits of every position feed the shared
Collector, exactly as for every other engine.

Speed (when asked), greedy decoding on a prompt cut from the window ids:

* batch 1: time to first token on a ``prompt_tokens`` prompt, then decode tok/s over ``gen_tokens``
  tokens, ``repeats`` times (median/min/max);
* N concurrent sequences for each N in ``parallel``: ExLlamaV2's dynamic generator (paged attention,
  which needs flash-attn). Where paged attention is unavailable the runner says so and times a
  batched forward with an N-row cache instead (``tool`` names which one was measured).

Imports only ``evaluators.protocol``, numpy, torch and exllamav2.
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
    stats,
    write_result,
)


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


def _single_stream(model: Any, prompt: list[int], gen: int, repeats: int) -> dict[str, Any]:
    import torch
    from exllamav2 import ExLlamaV2Cache

    cache = ExLlamaV2Cache(model, max_seq_len=len(prompt) + gen + 8, batch_size=1)
    ids = torch.tensor([prompt], dtype=torch.long)
    ttft, tg, pp = [], [], []
    with torch.inference_mode():
        cache.current_seq_len = 0
        model.forward(ids[:, :16], cache, last_id_only=True)  # warm-up: kernels, autotune
        for _ in range(repeats):
            cache.current_seq_len = 0
            _sync()
            t0 = time.perf_counter()
            logits = model.forward(ids, cache, last_id_only=True)
            tok = int(torch.argmax(logits[0, -1]))
            _sync()
            t1 = time.perf_counter()
            for _ in range(gen):
                logits = model.forward(torch.tensor([[tok]]), cache, last_id_only=True)
                tok = int(torch.argmax(logits[0, -1]))
            _sync()
            t2 = time.perf_counter()
            ttft.append((t1 - t0) * 1000.0)
            pp.append(len(prompt) / (t1 - t0))
            tg.append(gen / (t2 - t1))
    return {"ttft_ms": stats(ttft), "prompt_tok_per_s": stats(pp), "decode_tok_per_s": stats(tg)}


def _dynamic(model: Any, tokenizer: Any, prompt: list[int], n: int, gen: int) -> dict[str, Any]:
    """Aggregate decode throughput of ``n`` concurrent greedy jobs in the dynamic generator."""
    import torch
    from exllamav2 import ExLlamaV2Cache
    from exllamav2.generator import ExLlamaV2DynamicGenerator, ExLlamaV2DynamicJob, ExLlamaV2Sampler

    pages = -(-n * (len(prompt) + gen + 16) // 256) * 256
    cache = ExLlamaV2Cache(model, max_seq_len=pages, batch_size=1)
    generator = ExLlamaV2DynamicGenerator(model=model, cache=cache, tokenizer=tokenizer, max_batch_size=n,
                                          paged=True)

    def run() -> tuple[int, float]:
        for i in range(n):
            generator.enqueue(ExLlamaV2DynamicJob(input_ids=torch.tensor([prompt]), max_new_tokens=gen,
                                                  min_new_tokens=gen, stop_conditions=[],
                                                  gen_settings=ExLlamaV2Sampler.Settings.greedy(), identifier=i))
        done = 0
        _sync()
        t0 = time.perf_counter()
        while generator.num_remaining_jobs():
            for r in generator.iterate():
                if r["stage"] == "streaming" and "token_ids" in r:
                    done += int(r["token_ids"].shape[-1])
        _sync()
        return done, time.perf_counter() - t0

    run()  # warm-up
    tokens, secs = run()
    return {"aggregate_tok_per_s": tokens / secs, "tokens": tokens, "seconds": secs}


def _batched_forward(model: Any, prompt: list[int], n: int, gen: int) -> dict[str, Any]:
    """Fallback without paged attention: prefill ``n`` copies, then ``gen`` batched decode steps."""
    import torch
    from exllamav2 import ExLlamaV2Cache

    cache = ExLlamaV2Cache(model, max_seq_len=len(prompt) + gen + 8, batch_size=n)
    ids = torch.tensor([prompt] * n, dtype=torch.long)
    with torch.inference_mode():
        cache.current_seq_len = 0
        logits = model.forward(ids, cache, last_id_only=True)
        toks = torch.argmax(logits[:, -1], dim=-1, keepdim=True).cpu()
        _sync()
        t0 = time.perf_counter()
        for _ in range(gen):
            logits = model.forward(toks, cache, last_id_only=True)
            toks = torch.argmax(logits[:, -1], dim=-1, keepdim=True).cpu()
        _sync()
        secs = time.perf_counter() - t0
    return {"aggregate_tok_per_s": n * gen / secs, "tokens": n * gen, "seconds": secs}


def _parallel(model: Any, tokenizer: Any, prompt: list[int], speed: dict[str, Any]) -> dict[str, Any]:
    gen = int(speed["parallel_gen_tokens"])
    rows: dict[str, Any] = {}
    tool = "exllamav2 dynamic generator"
    for n in speed["parallel"]:
        try:
            rows[str(n)] = _dynamic(model, tokenizer, prompt, int(n), gen) if tool.endswith("generator") \
                else _batched_forward(model, prompt, int(n), gen)
        except (AssertionError, ImportError, RuntimeError) as exc:
            if not tool.endswith("generator"):
                raise
            tool = f"batched model.forward (dynamic generator unavailable: {type(exc).__name__}: {exc})"
            rows[str(n)] = _batched_forward(model, prompt, int(n), gen)
    return {"by_parallel": rows, "tool": tool, "prompt_tokens": len(prompt), "gen_tokens": gen}


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
        flat = ids.reshape(-1).tolist()
        prompt = (flat * (speed["prompt_tokens"] // max(1, len(flat)) + 1))[: speed["prompt_tokens"]]
        result["speed"] = _single_stream(model, prompt, int(speed["gen_tokens"]), int(speed["repeats"]))
        result["speed"].update({"prompt_tokens": len(prompt), "gen_tokens": int(speed["gen_tokens"]),
                                "repeats": int(speed["repeats"])})
        if speed.get("parallel"):
            result["speed"]["parallel"] = _parallel(model, tokenizer, prompt[: speed["parallel_prompt_tokens"]],
                                                    speed)
    write_result(out_dir, result)
    sys.stdout.flush()
    os._exit(0)  # exllamav2's extension may tear down noisily at interpreter exit; the result is written


if __name__ == "__main__":
    np.seterr(all="ignore")
    main()
