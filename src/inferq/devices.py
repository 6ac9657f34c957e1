"""Published specifications of GPUs and model shapes, and the latency profile built on them.

Pure data (no clock, no Redis): the registry in :mod:`inferq.config` takes its
default latency profiles from here, :mod:`inferq.latency` turns a profile into
step and prefill times.

The latency form (issue 16) is the roofline of a decoder-only transformer:

- a **decode step** reads every weight and every resident KV-cache byte once, so
  it is memory-bandwidth bound (Pope et al., "Efficiently Scaling Transformer
  Inference", MLSys 2023, section 2; Kwon et al., vLLM, SOSP 2023)::

      step_s = overhead + seq_step x batch + (weight_bytes + kv_tokens x kv_bytes_per_token) / bw

- a **prefill** is compute bound: ``2 N`` FLOPs per token for the weights plus
  ``2 n_layer n_ctx d_attn`` for attention (Kaplan et al., "Scaling Laws for
  Neural Language Models", 2020, table 1), at an effective FLOP rate.

``bw`` and the FLOP rate are the card's datasheet peak times an efficiency. The
efficiencies and the fixed step terms come from one measurement (the issue's,
an H200 running a Llama-3.1-8B-shaped model in bf16 with CUDA graphs): the
decode steps fit ``4.6 ms + 0.030 ms per 1,000 resident KV tokens`` (131,072
bytes each, i.e. 4.37 TB/s = 91% of 4.8 TB/s), ~6 us per sequence in the batch,
and prefill ran at 41,636 tokens/s on 2,048-token prompts (70% of 989 TFLOP/s
with the attention term). Other cards get the same efficiencies: an assumption,
until :func:`inferq.latency.fit_profile` replaces it with their own measurements.
"""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field

#: Share of the datasheet memory bandwidth a decode step achieves (H200 fit: 4.37 / 4.8).
BW_EFFICIENCY = 0.91
#: Share of the datasheet dense bf16 FLOP rate a prefill achieves (H200: 41,636 tok/s at 2,048).
PREFILL_MFU = 0.70
#: Fixed cost of one decode step beyond reading the weights, ms (H200 fit: 4.6 - 16.06 GB / bw).
STEP_OVERHEAD_MS = 0.92
#: Cost of each sequence in a step beyond its KV bytes (sampling, per-row kernels), ms
#: (H200 fit: batch 128 at 2,048 tokens is 0.8 ms above the bandwidth line).
SEQ_STEP_MS = 0.006


@dataclass(frozen=True, slots=True)
class Gpu:
    """One card's datasheet figures.

    Attributes:
        name: lower-case key (``"h200"``).
        mem_bw_gbs: peak memory bandwidth, GB/s (10^9 bytes/s).
        bf16_tflops: peak dense bf16 tensor throughput, TFLOP/s (without sparsity).
        vram_mib: memory, MiB.
        source: where the figures come from.
    """

    name: str
    mem_bw_gbs: float
    bf16_tflops: float
    vram_mib: int
    source: str


#: Cards commonly used for serving, from their vendors' datasheets (dense figures:
#: NVIDIA quotes bf16 "with sparsity" at twice these).
GPUS: dict[str, Gpu] = {
    g.name: g
    for g in (
        Gpu("h200", 4_800, 989, 143_771, "NVIDIA H200 Tensor Core GPU datasheet (SXM), 2024"),
        Gpu("h100", 3_350, 989, 81_559, "NVIDIA H100 Tensor Core GPU datasheet (SXM5 80GB), 2023"),
        Gpu("a100", 2_039, 312, 81_920, "NVIDIA A100 Tensor Core GPU datasheet (SXM4 80GB), 2021"),
        Gpu("l40s", 864, 362, 49_152, "NVIDIA L40S GPU datasheet, 2023"),
        Gpu("a10g", 600, 70, 24_576, "AWS EC2 G5 instance page (A10G: 600 GB/s, 24 GB)"),
        Gpu("l4", 300, 121, 24_576, "NVIDIA L4 Tensor Core GPU datasheet, 2023"),
    )
}


@dataclass(frozen=True, slots=True)
class ModelShape:
    """A model's architecture, from its ``config.json``.

    Attributes:
        name: registry-style name.
        params_b: parameters, billions.
        layers: ``num_hidden_layers``.
        kv_heads: ``num_key_value_heads``.
        head_dim: ``hidden_size / num_attention_heads``.
        hidden: ``hidden_size`` (= attention width ``d_attn`` for these models).
        source: the config file.
    """

    name: str
    params_b: float
    layers: int
    kv_heads: int
    head_dim: int
    hidden: int
    source: str

    def kv_bytes_per_token(self, bytes_per_value: int = 2) -> int:
        """K and V of every layer: ``2 x layers x kv_heads x head_dim x bytes_per_value``."""
        return 2 * self.layers * self.kv_heads * self.head_dim * bytes_per_value

    @property
    def attn_width(self) -> int:
        """``n_layer x d_attn``, the attention FLOPs' factor per token and context token / 2."""
        return self.layers * self.hidden


MODEL_SHAPES: dict[str, ModelShape] = {
    s.name: s
    for s in (
        ModelShape("llama-3.1-8b", 8.03, 32, 8, 128, 4096, "meta-llama/Llama-3.1-8B config.json"),
        ModelShape("llama-2-13b", 13.0, 40, 40, 128, 5120, "meta-llama/Llama-2-13b-hf config.json"),
        ModelShape("llama-3.1-70b", 70.6, 80, 8, 128, 8192, "meta-llama/Llama-3.1-70B config.json"),
        ModelShape("mistral-7b", 7.24, 32, 8, 128, 4096, "mistralai/Mistral-7B-v0.3 config.json"),
        ModelShape("qwen2.5-7b", 7.62, 28, 4, 128, 3584, "Qwen/Qwen2.5-7B-Instruct config.json"),
        ModelShape(
            "smollm2-135m", 0.135, 30, 3, 64, 576, "HuggingFaceTB/SmolLM2-135M-Instruct config"
        ),
    )
}


class LatencyProfile(BaseModel):
    """How fast one model runs on one card: the terms of the roofline form above.

    Attributes:
        gpu: the card the figures describe (informational; a :data:`GPUS` key or a name).
        mem_bw_gbs: effective memory bandwidth of a decode step, GB/s.
        prefill_tflops: effective FLOP rate of a prefill, TFLOP/s.
        step_overhead_ms: fixed cost of a decode step, ms.
        seq_step_ms: extra cost per sequence in the step, ms.
        attn_width: ``n_layer x d_attn`` of the model (0: attention FLOPs ignored).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    gpu: str = "h200"
    mem_bw_gbs: float = Field(default=4_800 * BW_EFFICIENCY, gt=0)
    prefill_tflops: float = Field(default=989 * PREFILL_MFU, gt=0)
    step_overhead_ms: float = Field(default=STEP_OVERHEAD_MS, ge=0)
    seq_step_ms: float = Field(default=SEQ_STEP_MS, ge=0)
    attn_width: int = Field(default=0, ge=0)

    def scaled(self, speedup: float) -> LatencyProfile:
        """The same profile on a clock ``speedup`` x faster (every duration / ``speedup``)."""
        return self.model_copy(
            update={
                "mem_bw_gbs": self.mem_bw_gbs * speedup,
                "prefill_tflops": self.prefill_tflops * speedup,
                "step_overhead_ms": self.step_overhead_ms / speedup,
                "seq_step_ms": self.seq_step_ms / speedup,
            }
        )


def profile_for(gpu: str, shape: str | None = None) -> LatencyProfile:
    """The default profile of model ``shape`` on card ``gpu``: datasheet x efficiencies.

    Raises:
        KeyError: an unknown card or model shape (the message lists the known ones).
    """
    if gpu not in GPUS:
        raise KeyError(f"unknown gpu {gpu!r}; known: {', '.join(sorted(GPUS))}")
    if shape is not None and shape not in MODEL_SHAPES:
        raise KeyError(f"unknown model shape {shape!r}; known: {', '.join(sorted(MODEL_SHAPES))}")
    card = GPUS[gpu]
    return LatencyProfile(
        gpu=gpu,
        mem_bw_gbs=card.mem_bw_gbs * BW_EFFICIENCY,
        prefill_tflops=card.bf16_tflops * PREFILL_MFU,
        attn_width=MODEL_SHAPES[shape].attn_width if shape else 0,
    )
