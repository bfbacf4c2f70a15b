"""A small OpenAI-compatible server around ExLlamaV2's dynamic generator (CUDA only; a GPU path: whether it has
run on a GPU is recorded in ``pipeline/status.py``). Run as
``python -m evaluators.exllamav2.openai_server --model DIR --name NAME --port N --slots S --context C`` in the
ExLlamaV2 interpreter (evaluators/exllamav2/server.py builds the command; fastapi and uvicorn come with the
``exl2`` environment).

Routes: ``POST /v1/completions`` and ``POST /v1/chat/completions`` (server-sent events when ``stream``, ending
with a usage chunk when ``stream_options.include_usage``, then ``data: [DONE]``), ``GET /v1/models``,
``GET /health`` (200 once the model is loaded: the app starts listening only then).

A request may set ``prompt`` (text, or a list of token ids) or ``messages`` (rendered with the checkpoint's
chat template), ``max_tokens`` (default 16), ``min_tokens``, ``ignore_eos`` (exactly ``max_tokens`` tokens),
``temperature`` (0: greedy; default 1), ``top_p``, ``top_k``, ``seed`` and ``stop`` (strings). ``n`` > 1,
``best_of``, ``echo`` and ``logprobs`` are refused with 400 rather than ignored.

The generator runs up to ``--slots`` requests at once over one cache of ``slots`` × ``context`` tokens (rounded up
to 256-token pages), which needs paged attention (flash-attn ≥ 2.5.7); without it the server refuses more than one
slot instead of serving them one by one. ``--tensor-parallel N`` loads the model with ExLlamaV2's tensor
parallelism over N GPUs. At start it prints ``quantyard-exl2-server: {json}`` (cache bytes and tokens, paged,
batch size, devices) for the launcher. Imports only the standard library, torch, exllamav2, fastapi and uvicorn.
"""

from __future__ import annotations

import argparse
import json
import math
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

MARK = "quantyard-exl2-server:"
PAGE = 256
REFUSED = ("n", "best_of", "echo", "logprobs")


def cache_bytes(cache: Any) -> tuple[int, list[int]]:
    """Bytes of a (possibly tensor-parallel) ExLlamaV2 cache's key/value tensors, and the devices they are on."""
    parts = [c for c in getattr(cache, "caches", [cache]) if c is not None]
    tensors = [t for c in parts for t in (*c.key_states, *c.value_states) if t is not None]
    return sum(t.numel() * t.element_size() for t in tensors), sorted({int(t.device.index or 0) for t in tensors})


def load(args: argparse.Namespace) -> dict[str, Any]:
    """Load the model, its cache and tokenizer; print the launcher's line. Exits when more than one slot is
    asked without paged attention."""
    from exllamav2 import ExLlamaV2, ExLlamaV2Cache, ExLlamaV2Cache_TP, ExLlamaV2Config, ExLlamaV2Tokenizer
    from exllamav2.attn import has_flash_attn_with_paged

    if args.slots > 1 and not has_flash_attn_with_paged:
        raise SystemExit(f"{args.slots} slots need ExLlamaV2's paged attention (flash-attn >= 2.5.7), which this "
                         "environment lacks; serve with 1 slot or install flash-attn")
    config = ExLlamaV2Config(args.model)
    config.max_seq_len = args.context
    model = ExLlamaV2(config)
    tokens = math.ceil(args.slots * args.context / PAGE) * PAGE
    split = [float(x) for x in args.gpu_split.split(",")] if args.gpu_split else None
    if args.tensor_parallel > 1:
        model.load_tp(split, expect_cache_tokens=tokens)
        cache = ExLlamaV2Cache_TP(model, max_seq_len=tokens)
    elif split is not None:
        model.load(split)
        cache = ExLlamaV2Cache(model, max_seq_len=tokens)
    else:
        cache = ExLlamaV2Cache(model, max_seq_len=tokens, lazy=True)
        model.load_autosplit(cache)
    nbytes, devices = cache_bytes(cache)
    print(MARK, json.dumps({"cache_bytes": nbytes, "cache_tokens": tokens, "paged": bool(has_flash_attn_with_paged),
                            "max_batch_size": args.slots, "tp": args.tensor_parallel, "devices": devices}),
          flush=True)
    return {"model": model, "cache": cache, "tokenizer": ExLlamaV2Tokenizer(config), "config": config,
            "paged": bool(has_flash_attn_with_paged)}


def chat_prompt(model_dir: str, messages: list[dict[str, Any]], tokenizer: Any) -> str:
    """``messages`` rendered with the checkpoint's chat template (tokenizer_config.json).

    Raises:
        ValueError: the checkpoint has no chat template.
    """
    import jinja2

    cfg_path = Path(model_dir) / "tokenizer_config.json"
    template = json.loads(cfg_path.read_text()).get("chat_template") if cfg_path.is_file() else None
    if not isinstance(template, str):
        raise ValueError("this checkpoint has no chat template: use /v1/completions")
    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
    return env.from_string(template).render(messages=messages, add_generation_prompt=True,
                                            bos_token=tokenizer.bos_token, eos_token=tokenizer.eos_token)


def make_job(state: dict[str, Any], body: dict[str, Any], ids: list[int]) -> Any:
    """An async generator job for one request (sampling and stop rules from ``body``)."""
    import torch
    from exllamav2.generator import ExLlamaV2DynamicJobAsync, ExLlamaV2Sampler

    tokenizer = state["tokenizer"]
    temperature = float(body.get("temperature", 1.0))
    if temperature == 0:
        settings = ExLlamaV2Sampler.Settings.greedy()
    else:
        settings = ExLlamaV2Sampler.Settings(temperature=temperature, top_p=float(body.get("top_p") or 1.0),
                                             top_k=int(body.get("top_k") or 0), token_repetition_penalty=1.0)
    max_tokens = int(body.get("max_tokens") or 16)
    ignore_eos = bool(body.get("ignore_eos"))
    stop = body.get("stop") or []
    stops = [] if ignore_eos else [tokenizer.eos_token_id, *([stop] if isinstance(stop, str) else stop)]
    return ExLlamaV2DynamicJobAsync(state["generator"], input_ids=torch.tensor([ids]), max_new_tokens=max_tokens,
                                    min_new_tokens=max_tokens if ignore_eos else int(body.get("min_tokens") or 0),
                                    gen_settings=settings, seed=body.get("seed"), stop_conditions=stops)


def _finish(result: dict[str, Any]) -> str:
    return "length" if result.get("eos_reason") == "max_new_tokens" else "stop"


def _chunk(kind: str, rid: str, name: str, text: str | None, finish: str | None) -> dict[str, Any]:
    if kind == "chat":
        delta = {} if text is None else {"content": text}
        choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": finish}
        obj = "chat.completion.chunk"
    else:
        choice, obj = {"index": 0, "text": text or "", "finish_reason": finish}, "text_completion"
    return {"id": rid, "object": obj, "created": int(time.time()), "model": name, "choices": [choice]}


async def stream(job: Any, kind: str, name: str, n_prompt: int, usage: bool) -> AsyncIterator[str]:
    """Server-sent events of ``job``: one chunk per generator result that carries text, a final chunk with
    the finish reason, a usage chunk when asked, then ``[DONE]``. The job is cancelled when the client
    goes away."""
    rid, n_out, finish = f"cmpl-{uuid.uuid4().hex}", 0, "stop"
    if kind == "chat":
        first = _chunk(kind, rid, name, None, None)
        first["choices"][0]["delta"] = {"role": "assistant", "content": ""}
        yield f"data: {json.dumps(first)}\n\n"
    done = False
    try:
        async for result in job:
            if result.get("stage") != "streaming":
                continue
            n_out += int(result["token_ids"].shape[-1]) if "token_ids" in result else 0
            if result.get("text"):
                yield f"data: {json.dumps(_chunk(kind, rid, name, result['text'], None))}\n\n"
            if result.get("eos"):
                done, finish = True, _finish(result)
    except BaseException:
        if not done:  # the client went away: free the job's cache pages
            await job.cancel()
        raise
    yield f"data: {json.dumps(_chunk(kind, rid, name, None, finish))}\n\n"
    if usage:
        last = {**_chunk(kind, rid, name, None, None), "choices": [],
                "usage": {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out}}
        yield f"data: {json.dumps(last)}\n\n"
    yield "data: [DONE]\n\n"


async def complete(job: Any, kind: str, name: str, n_prompt: int) -> dict[str, Any]:
    """The whole answer of ``job`` as one (non-streamed) response."""
    text, n_out, finish, done = "", 0, "stop", False
    try:
        async for result in job:
            if result.get("stage") != "streaming":
                continue
            text += result.get("text", "")
            n_out += int(result["token_ids"].shape[-1]) if "token_ids" in result else 0
            if result.get("eos"):
                done, finish = True, _finish(result)
    except BaseException:
        if not done:
            await job.cancel()
        raise
    choice: dict[str, Any] = {"index": 0, "finish_reason": finish}
    choice.update({"message": {"role": "assistant", "content": text}} if kind == "chat" else {"text": text})
    return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "chat.completion" if kind == "chat" else "text_completion",
            "created": int(time.time()), "model": name, "choices": [choice],
            "usage": {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out}}


def prompt_ids(state: dict[str, Any], body: dict[str, Any], kind: str, model_dir: str) -> list[int]:
    """The request's prompt as token ids (a text prompt gets the BOS token, as llama.cpp and vLLM add it).

    Raises:
        ValueError: no usable prompt, or a refused field.
    """
    if (body.get("n") or 1) != 1 or (body.get("best_of") or 1) != 1 or body.get("echo") or body.get("logprobs"):
        raise ValueError(f"{', '.join(REFUSED)} (n or best_of above 1, echo, logprobs) are not supported here")
    tokenizer = state["tokenizer"]
    if kind == "chat":
        text = chat_prompt(model_dir, list(body.get("messages") or []), tokenizer)
        return [int(t) for t in tokenizer.encode(text, add_bos=False, encode_special_tokens=True)[0].tolist()]
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return [int(t) for t in prompt]
    if not isinstance(prompt, str) or not prompt:
        raise ValueError("'prompt' must be a non-empty string or a list of token ids")
    return [int(t) for t in tokenizer.encode(prompt, add_bos=True)[0].tolist()]


def build_app(args: argparse.Namespace) -> Any:
    """The FastAPI app: the model loads before the app accepts requests (its lifespan)."""
    from exllamav2.generator import ExLlamaV2DynamicGeneratorAsync
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, StreamingResponse

    state: dict[str, Any] = {}

    @asynccontextmanager
    async def lifespan(app: Any) -> AsyncIterator[None]:
        state.update(load(args))
        state["generator"] = ExLlamaV2DynamicGeneratorAsync(
            model=state["model"], cache=state["cache"], tokenizer=state["tokenizer"], max_batch_size=args.slots,
            max_seq_len=args.context, paged=state["paged"])
        yield
        await state["generator"].close()

    app = FastAPI(lifespan=lifespan)

    async def serve(request: Request, kind: str) -> Any:
        body = await request.json()
        try:
            ids = prompt_ids(state, body, kind, args.model)
        except ValueError as exc:
            return JSONResponse({"error": {"message": str(exc), "type": "invalid_request_error"}}, status_code=400)
        job = make_job(state, body, ids)
        if body.get("stream"):
            usage = bool((body.get("stream_options") or {}).get("include_usage"))
            return StreamingResponse(stream(job, kind, args.name, len(ids), usage), media_type="text/event-stream")
        return JSONResponse(await complete(job, kind, args.name, len(ids)))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        return await serve(request, "text")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        return await serve(request, "chat")

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": args.name, "object": "model", "owned_by": "quantyard",
                                            "max_model_len": args.context}]}

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    return app


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--name", required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--slots", type=int, default=1)
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--tensor-parallel", type=int, default=1)
    p.add_argument("--gpu-split", default=None)
    return p.parse_args(argv)


def main() -> None:
    import uvicorn

    args = parse()
    uvicorn.run(build_app(args), host=args.host, port=args.port, log_level="info", access_log=False)


if __name__ == "__main__":
    main()
