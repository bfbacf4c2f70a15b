"""Serving results: one variant behind its engine's OpenAI-compatible server, loaded by many users.

A serving result (``EvalResult(kind="serving")``, its ``metrics`` a :class:`ServingMetrics` dump) says which
server ran the variant with which flags on which hardware, the load profile, one :class:`LevelStats` per load
level (closed loop: a number of concurrent users; open loop: a Poisson request rate), and the memory it
measured. Latency fields carry ``vllm bench serve``'s names and definitions (evaluators/serving/metrics.py
computes them from the raw per-request timestamps, which are kept in ``requests``):

* ``ttft_ms``: time to first token, request sent → first content token received;
* ``tpot_ms``: time per output token after the first, (t_last − t_first) / (n_output − 1), per request
  (GuideLLM calls this ITL);
* ``itl_ms``: inter-token latency, every gap between consecutive streamed tokens, pooled over requests;
* ``e2el_ms``: end-to-end latency, request sent → last token;

each as ``{"mean", "median", "p90", "p99"}``; ``request_throughput`` (completed requests / s),
``output_throughput`` (output tokens / s) and ``total_token_throughput`` over the level's wall time;
``request_goodput`` (requests / s meeting the SLO) and ``failed`` (requests that errored or timed out).

Everything here is a measurement; nothing is estimated. A level that did not run is absent, not zero.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

#: The version of the definitions above; a result computed otherwise says so by another string.
DEFINITIONS = "quantyard-serving/1 (vllm bench serve names)"


class Percentiles(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    mean: float
    median: float
    p90: float
    p99: float


class RequestRecord(BaseModel):
    """One request as the client saw it (seconds on the client's monotonic clock, relative to the level's
    start), with the token counts the server reported (``usage``) and the client's own count of the text."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    t_sent: float
    #: open loop: when the client's Poisson schedule meant to send it (GuideLLM's ``targeted_start``); None in a
    #: closed loop, where every request is due as soon as its user is free
    t_target: float | None = None
    t_first: float | None = None  # first content token; None when none arrived
    t_last: float | None = None
    token_times: list[float] = Field(default_factory=list)  # arrival of every streamed token (or chunk)
    prompt_tokens: int | None = None  # server usage
    output_tokens: int | None = None  # server usage
    output_tokens_client: int | None = None  # the client's tokenizer on the received text
    error: str | None = None  # set for a failed request (HTTP error, timeout, cut stream)


class LevelStats(BaseModel):
    """One load level: ``concurrency`` users in a closed loop, or ``rate`` requests per second (Poisson)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    mode: Literal["concurrency", "poisson"]
    concurrency: int | None = None
    rate: float | None = None
    requests: int  # measured requests (warm-up excluded)
    completed: int
    failed: int
    duration_s: float
    ttft_ms: Percentiles | None = None
    tpot_ms: Percentiles | None = None
    itl_ms: Percentiles | None = None
    e2el_ms: Percentiles | None = None
    #: open loop: how late the client sent each request after its scheduled arrival (t_sent - t_target); a
    #: client that falls behind its schedule offers a burstier load than the rate says
    dispatch_delay_ms: Percentiles | None = None
    request_throughput: float | None = None
    output_throughput: float | None = None
    total_token_throughput: float | None = None
    request_goodput: float | None = None
    rss_peak_bytes: int | None = None  # CPU: resident memory of the server's process tree, peak during the level
    device_peak_bytes: int | None = None  # GPU: peak device memory during the level
    #: GuideLLM runs of the level: 2 when the first sent its Poisson arrivals in a burst (evaluators/serving/load.py)
    attempts: int = 1
    requests_log: list[RequestRecord] = Field(default_factory=list)


class ServerInfo(BaseModel):
    """The server as started: what a reader needs to reproduce it."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    engine: str  # llama.cpp | vllm | exllamav2
    server: str  # llama-server | vllm serve | quantyard exllamav2 server
    version: str
    command: list[str]
    parallel_slots: int | None = None  # llama-server --parallel / vLLM --max-num-seqs
    context_per_request: int | None = None
    context_total: int | None = None  # llama-server -c (= slots × per-request context)
    continuous_batching: bool | None = None
    tensor_parallel: int = 1
    parallelism: dict[str, Any] = Field(default_factory=dict)  # --split-mode / --tensor-split / TP flags
    flags: dict[str, Any] = Field(default_factory=dict)


class MemoryInfo(BaseModel):
    """Memory, measured: the weights on disk, the server after load, its peak under load, the KV cache the
    engine reported at this context and concurrency."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    weights_bytes: int
    rss_after_load_bytes: int | None = None
    rss_peak_bytes: int | None = None
    device_after_load_bytes: int | None = None
    device_peak_bytes: int | None = None
    kv_cache_bytes: int | None = None
    kv_cache_tokens: int | None = None
    kv_cache_source: str | None = None  # where the engine said it (a log line, an endpoint)
    context: int | None = None
    concurrency: int | None = None

    @property
    def peak_bytes(self) -> int | None:
        """What the variant needed at its heaviest measured level: device memory on a GPU, else RSS."""
        return self.device_peak_bytes or self.rss_peak_bytes


class LoadProfile(BaseModel):
    """How the load was generated."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: Literal["seed", "sweep", "cpu-scaled", "custom"]
    tool: str  # e.g. "guidellm 0.8.1"
    prompt_tokens: int
    output_tokens: int
    concurrencies: list[int] = Field(default_factory=list)
    rates: list[float] = Field(default_factory=list)
    requests_per_level: int
    warmup_requests: int
    timeout_s: float
    temperature: float = 0.0
    ignore_eos: bool = True
    prompt_cache_defeated: bool = True  # every prompt distinct
    slo_ttft_ms: float | None = None
    slo_itl_ms: float | None = None
    note: str | None = None  # e.g. "CPU: scaled from the seed shape 512/256, 1/8/32/64 users"


class ServingMetrics(BaseModel):
    """The ``metrics`` of a serving result."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    definitions: str = DEFINITIONS
    server: ServerInfo
    profile: LoadProfile
    levels: list[LevelStats]
    memory: MemoryInfo
    knee: dict[str, Any] | None = None  # open loop: the highest rate that met the SLO, and the first that did not
    #: Where the raw per-request logs are (a ``serving_log`` source artifact: kind, key, sha256, size), when
    #: they are kept outside the result (the levels' ``requests_log`` are then empty).
    requests_log_artifact: dict[str, Any] | None = None

    def level(self, concurrency: int) -> LevelStats | None:
        return next((lv for lv in self.levels if lv.mode == "concurrency" and lv.concurrency == concurrency), None)


def serving_metrics(metrics: dict[str, Any]) -> ServingMetrics | None:
    """A stored serving result's metrics as the model (None when they are not one: another kind, or an older
    definition)."""
    try:
        return ServingMetrics.model_validate(metrics)
    except ValueError:
        return None
