"""ESTIMATES of what a piece of work needs (memory, disk) from a checkpoint's shape, before it runs.

Every number here is an estimate and is labelled as one where it is shown. Each formula is the sum of what the
process holds at its peak: weights it loads into its own memory (not a file it memory-maps: see
pipeline/resources.py), the largest activations, and its interpreter. The constants were measured with
:class:`pipeline.resources.Sampler` on the demo, SmolLM2-135M, a synthetic 0.77 B and a synthetic 7.4 B
checkpoint (bench/results/footprint_*.txt holds each measurement beside its estimate; the tests in
tests/pipeline/test_footprint.py hold the estimate to at least the measurement at the sizes run there).

The facts come from config.json and the safetensors headers (:class:`ModelFacts`), never from the weights.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

GIB = 1024**3
MIB = 1024**2
#: A Python interpreter with torch and transformers imported and a model's code loaded (measured 0.6-0.8 GiB).
TORCH_PROCESS = int(0.9 * GIB)
#: A Python interpreter with llama-cpp-python and numpy (measured 0.15-0.25 GiB).
LLAMA_PROCESS = int(0.3 * GIB)
#: A vLLM engine process on CPU before weights and KV cache (measured about 1.5 GiB).
VLLM_PROCESS = int(2.0 * GIB)
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "F32": 4, "BF16": 2, "F16": 2}
#: Memory of a choice counts as fitting "comfortably" (the reference engine's automatic choice) when it is at
#: most this share of what is available: the estimate's error and the rest of the machine's work.
COMFORT = 0.8


@dataclass(frozen=True)
class ModelFacts:
    """What the estimates need to know about a checkpoint (config.json and the safetensors headers)."""

    n_params: int
    stored_bytes: int
    dtype: str  # the stored weights' torch dtype: float32, bfloat16, float16
    vocab: int
    hidden: int
    layers: int
    kv_width: int  # key/value heads × head size (the width of one layer's K or V cache per token)
    intermediate: int
    largest: int  # elements of the largest tensor
    embedding_params: int  # token embedding plus an untied output head

    @classmethod
    def from_config(cls, config: dict[str, Any], tensors: dict[str, tuple[int, ...]], stored_bytes: int,
                    dtype: str) -> ModelFacts:
        """From config.json (a multimodal model's ``text_config``) and every stored tensor's shape by name."""
        text = config.get("text_config")
        cfg: dict[str, Any] = text if isinstance(text, dict) else config
        hidden = int(cfg.get("hidden_size") or cfg.get("n_embd") or cfg.get("d_model") or 0)
        heads = int(cfg.get("num_attention_heads") or cfg.get("n_head") or 1)
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        head_dim = int(cfg.get("head_dim") or (hidden // max(heads, 1)))
        sizes = {name: math.prod(shape) for name, shape in tensors.items()}
        vocab = int(cfg.get("vocab_size") or 0)
        embedding = sum(n for name, n in sizes.items()
                        if any(k in name for k in ("embed_tokens", "wte", "lm_head", "embed_out", "word_embeddings")))
        return cls(n_params=sum(sizes.values()), stored_bytes=stored_bytes, dtype=dtype, vocab=vocab,
                   hidden=hidden, layers=int(cfg.get("num_hidden_layers") or cfg.get("n_layer") or 1),
                   kv_width=kv_heads * head_dim,
                   intermediate=int(cfg.get("intermediate_size") or cfg.get("n_inner") or 4 * hidden),
                   largest=max(sizes.values(), default=0), embedding_params=embedding)


@dataclass(frozen=True)
class Need:
    """One piece of work's ESTIMATED peak memory (its own process tree, module docstring) and what it is."""

    what: str  # "the reference: transformers, float32, on the checkpoint"
    memory: int
    parts: tuple[tuple[str, int], ...] = field(default_factory=tuple)  # (part, bytes), summing to ``memory``
    #: The stages of a run's graph it is the estimate of (flows/graph.py names, ``*`` a wildcard: ``build:*``,
    #: ``evaluate:Q8_0:llama.cpp``), so that a run's measured usage can be set beside it.
    stage: str = ""

    @classmethod
    def of(cls, what: str, *parts: tuple[str, int]) -> Need:
        return cls(what, sum(b for _, b in parts), tuple((p, int(b)) for p, b in parts if b))

    def at(self, stage: str) -> Need:
        """This estimate, for ``stage``."""
        return replace(self, stage=stage)

    def describe(self) -> str:
        inner = " + ".join(f"{p} {_size(b)}" for p, b in self.parts)
        return f"{self.what}: ~{_size(self.memory)} (ESTIMATE: {inner})"

    def share(self, *parts: str) -> float:
        """The share of the estimate that ``parts`` make up."""
        return sum(b for p, b in self.parts if p in parts) / max(1, self.memory)


def _size(n: int) -> str:
    return f"{n / GIB:.1f} GiB" if n >= GIB else f"{n / MIB:.0f} MiB"


# --- one formula per kind of work -----------------------------------------------------------------------------


def logits_bytes(facts: ModelFacts, window: int) -> int:
    """A window's logits in float32 and the copies scoring makes of them (log-softmax, the stored distribution's
    16-bit codes, a sort for the top-K): about four float32 copies."""
    return 4 * window * facts.vocab * 4


def torch_forward(facts: ModelFacts, dtype: str, window: int, what: str) -> Need:
    """A transformers model held whole in ``dtype`` and run over windows of ``window`` tokens."""
    weights = facts.n_params * DTYPE_BYTES.get(dtype, 4)
    acts = 12 * window * max(facts.hidden, facts.intermediate) * 4
    return Need.of(what, ("weights", weights), ("activations", acts), ("logits", logits_bytes(facts, window)),
                   ("interpreter", TORCH_PROCESS))


def kv_cache_bytes(facts: ModelFacts, context: int) -> int:
    """llama.cpp's default F16 K and V caches for ``context`` tokens."""
    return 2 * facts.layers * context * facts.kv_width * 2


def llama_cpp_run(facts: ModelFacts, file_bytes: int, quantized: bool, window: int, what: str,
                  context: int | None = None) -> Need:
    """llama.cpp over windows of a GGUF it memory-maps. Its own memory: the weights its CPU backend repacks into
    an interleaved layout (some quantized types, on AVX2/AVX-512: counted as the whole file, an upper bound;
    float types are used from the mapping), the KV cache of ``context`` tokens (default: a window), the compute
    buffer, and the scored logits."""
    repacked = file_bytes if quantized else 0
    compute = window * (facts.vocab + 8 * max(facts.hidden, facts.intermediate)) * 4
    kv = kv_cache_bytes(facts, max(window, context or 0))
    return Need.of(what, ("repacked weights", repacked), ("KV cache", kv),
                   ("compute buffer", compute), ("logits", logits_bytes(facts, window)),
                   ("interpreter", LLAMA_PROCESS))


def gguf_conversion(facts: ModelFacts) -> Need:
    """llama.cpp's convert_hf_to_gguf.py: lazy tensors, written one at a time (a few copies of the largest)."""
    return Need.of("the GGUF base conversion (convert_hf_to_gguf.py)", ("largest tensor × 3, float32",
                                                                       3 * facts.largest * 4),
                   ("interpreter", TORCH_PROCESS))


def gguf_quantize(facts: ModelFacts) -> Need:
    """llama-quantize: one tensor at a time, converted to float32 and quantized into a buffer."""
    return Need.of("llama-quantize", ("largest tensor × 2, float32", 2 * facts.largest * 4), ("process", 300 * MIB))


def awq_calibration(facts: ModelFacts, compute_dtype: str, samples: int, seq_len: int) -> Need:
    """llm-compressor's AWQ on a CPU: the whole model in the compute dtype, the calibration samples' activations
    cached between layers, one layer's activations at the MLP's width."""
    weights = facts.n_params * DTYPE_BYTES.get(compute_dtype, 4)
    cache = 3 * samples * seq_len * facts.hidden * 4
    layer = 4 * samples * seq_len * facts.intermediate * 4
    return Need.of(f"AWQ calibration (llm-compressor, {compute_dtype})", ("weights", weights),
                   ("cached activations", cache), ("one layer's activations", layer),
                   ("interpreter", TORCH_PROCESS + 512 * MIB))


def quantized_bytes(facts: ModelFacts, bits: float, head_bits: float = 16.0) -> int:
    """A quantized model's weights: the body at ``bits`` per weight (with its scales), the embedding and output
    head at ``head_bits``."""
    body = max(0, facts.n_params - facts.embedding_params)
    return int(body * bits / 8 + facts.embedding_params * head_bits / 8)


def vllm_run(facts: ModelFacts, weights: int, kv_cache: int, window: int, what: str) -> Need:
    return Need.of(what, ("weights", weights), ("KV cache", kv_cache), ("logits", logits_bytes(facts, window)),
                   ("engine", VLLM_PROCESS))


def fits(need: int, available: int, comfort: float = 1.0) -> bool:
    return need <= available * comfort
