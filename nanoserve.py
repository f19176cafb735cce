"""nanoserve: a whole LLM inference engine in one file.

This file serves Llama, Qwen3, Qwen2.5 and Mistral models the way the big engines do: a paged KV
cache with a block allocator and prefix caching, a continuous-batching scheduler that mixes chunked
prefills and decodes in one step (at a burst of prompts, decodes sit out three steps of four),
batched sampling with grammars, each step replayed as one CUDA graph, and an OpenAI-compatible
server with SSE streaming. The kernels live in paged_attention.py. Part one took 254 minutes in the
last timed read (README.md's reading path), the chapters about 280.

Left out on purpose: pipeline parallelism, quantization other than fp8 weights and an fp8 KV
cache (no int4, no checkpoint stored quantized), speculative decoding with a draft model, LoRA,
beam search, multimodal inputs, sliding-window attention and every other model family.

Run it:
    python download.py                                  # SmolLM2-135M-Instruct
    python nanoserve.py generate "The capital of France is" --temperature 0
    python nanoserve.py serve --port 8000               # OpenAI API on 127.0.0.1
    python nanoserve.py generate "Hello" --part-one     # part one's engine alone, as it reads
    pytest -q test_nanoserve.py                         # checked against transformers

Checked against: transformers (each layer to ~1e-5 in fp32, and greedy
decoding token for token), and the kernels against their torch references.

It reads in two parts. Part one, Config to CLI, is a whole engine: a plain synchronous step, and
a server that steps it in a thread. --part-one runs it alone (LLM(part_one=True) in Python), and
a test proves its tokens equal the default engine's. A request enters at the HTTP handler or
LLM.generate, and the FrontEnd tokenizes it. In the engine core it becomes a Sequence, is
scheduled into a flat batch, runs through Model.forward and is sampled, and the FrontEnd turns
its token ids into text. Then come the chapters, one per feature. A chapter extends part one's
classes from below it: a subclass that overrides whole methods, most of them handing on to part
one's with super(). Where a chapter changes what a step does for each row (_flatten's loop),
it writes the whole loop again rather than add a call per row to the hot path. The default
engine is assembled from them at the end of the file, where main, the CLI's entry, is too.

    chapter                     what it adds                               what it extends
    async scheduling            step N+1 launched before N is read back    Sequence, Scheduler,
                                                                           ModelRunner, EngineCore
    CUDA graphs                 a step replayed as one graph               ModelRunner
    the engine core process     the engine core in a process of its own    EngineCoreClient
    incremental detokenization  a step decodes a window: its new tokens    RequestState, FrontEnd
                                and a few before them
    stop strings                text cut at a stop string                  SamplingParams,
                                                                           RequestState, FrontEnd
    prefix caching              blocks shared by prompts that begin alike  BlockAllocator, Sequence,
                                                                           Scheduler, EngineCore,
                                                                           EngineCoreOutput,
                                                                           RequestState, FrontEnd
    the burst rule              decodes wait at a burst of prompts         Scheduler
    speculative decoding        drafts by prompt lookup, checked at once   Sequence, Scheduler,
                                                                           ModelRunner, EngineCore,
                                                                           speed_line
    log-probs and logit edits   log-probs; logit_bias and penalties        SamplingParams, FrontEnd,
                                                                           RequestState, Delta,
                                                                           EngineCoreOutput,
                                                                           OpenAIServer, Sequence,
                                                                           ModelRunner, EngineCore
    structured output           grammars and tool calls                    SamplingParams, FrontEnd,
                                                                           OpenAIServer, Sequence,
                                                                           ModelRunner, EngineCore
    tensor parallelism          the model cut over GPUs                    ModelRunner, Attention
                                                                           and MLP (forward hooks)
    fp8 weights                 e4m3 weights, a scale per row              ModelRunner
    fp8 KV cache                an e4m3 KV pool                            ModelRunner
    the rest of the OpenAI API  field tables, API key, /metrics, errors    OpenAIServer,
                                                                           EngineCoreClient
    the Responses API           /v1/responses                              OpenAIServer
    faults                      a fault ends only the requests it touches  LLM.run

What a chapter changes in part one is a whole method it overrides, or a hook torch calls around
a module's forward; under --part-one, part one's classes run as if the chapters were not there.
So part one's code has a few seams, each plain in part one: class attributes that name the
classes an engine is built from (EngineCore.allocator_class and its siblings, FrontEnd.state_class,
LLM.engine_class); methods split so that one piece can be overridden (ModelRunner._put_input_ids,
head, draw, copy_to_host); LaunchedStep.host, a list (the tokens alone here); EngineCore.committed
(a step's outputs as it makes them); and FrontEnd.process's `stopped` (always empty here).
The exceptions are three names the end of the file rebinds, for --part-one's runs too: two
chapters wrap a part-one function (speed_line, LLM.run), and SamplingParams comes to mean the
default engine's, whose fields beyond part one's --part-one refuses.
"""

from __future__ import annotations

import argparse, asyncio, contextlib, copy, dataclasses, faulthandler, functools, hmac, json, math
import multiprocessing, os, queue, re, signal, socket, sys, threading, time, traceback, uuid
import multiprocessing.connection, multiprocessing.resource_tracker, multiprocessing.util, weakref
from collections import OrderedDict, deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import jinja2.sandbox                    # also binds jinja2
import llguidance
import numpy as np
import prometheus_client
import torch
import torch.distributed as dist
import torch.nn as nn
import uvicorn
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

import paged_attention as pa

# Dimension letters used in every shape comment:
#   B        sequences in a step;  T  tokens of one sequence
#   N_tok    tokens of a step, all sequences flattened (prefill chunks + decodes)
#   D        hidden size;  I  MLP intermediate size;  V  vocabulary size
#   n_heads  query heads;  n_kv  key/value heads;  hd  head dim
#   num_blocks, block_size   the paged KV pool: block_size tokens per block

DEFAULT_MODEL = str(Path(__file__).resolve().parent / "weights" / "SmolLM2-135M-Instruct")

# ---------------------------------------------------------------------------
# Config
# One dataclass holds every setting. The engine's come from the caller, and each is a CLI flag.
# The architecture's come from config.json (__post_init__). So a Config is always complete and
# checked. The help strings use five words that later sections tell whole. The KV pool holds every
# sequence's keys and values, in blocks. A step is one forward pass, and its token budget caps
# its tokens. The seats are the sequences that may run at once. A CUDA graph replays a step.

def _flag(default, help: str, flag: Optional[str] = None):
    """A field that is also a CLI flag, `--field-name` or `flag` (the CLI section makes it)."""
    return field(default=default, metadata={"help": help, "flag": flag})

@dataclass
class Config:
    # -- engine settings: each one is a CLI flag --
    model: str = _flag(DEFAULT_MODEL, "folder of config.json, model.safetensors, tokenizer.json")
    device: str = _flag("auto", "cuda or cpu (auto: cuda when there is one)")
    dtype: str = _flag("auto", "float32, bfloat16 or float16 (auto: bf16 on cuda, fp32 on cpu)")
    attention: str = _flag("auto", "paged-attention implementation: triton, sdpa or torch "
                                   "(auto: triton on cuda, sdpa on cpu)")
    block_size: int = _flag(16, "tokens per KV-cache block (a power of two)")
    num_blocks: int = _flag(0, "KV blocks in the pool (0: sized from memory)")
    gpu_memory_utilization: float = _flag(0.90, "GPU memory for weights, activations, KV pool")
    cpu_kv_cache_gb: float = _flag(1.0, "KV pool size in GB on cpu")
    max_num_seqs: int = _flag(1024, "seats: most sequences running at once")
    max_num_batched_tokens: int = _flag(8192, "token budget of one step (prefill chunks + decodes)")
    max_model_len: int = _flag(0, "longest prompt + completion (0: the model's limit)")
    enable_prefix_caching: bool = _flag(True, "reuse the KV blocks of prompts seen before",
                                        "--no-prefix-caching")
    enforce_eager: bool = _flag(False, "no CUDA graphs (else on for triton attention on cuda; "
                                "part one's engine has none)")
    num_threads: int = _flag(0, "torch threads of the engine on cpu (0: one per core it may use)")
    tensor_parallel_size: int = _flag(1, "GPUs the model is split over (on cpu: processes)")
    quantization: Optional[str] = _flag(None, "fp8: the layers' weights in fp8 e4m3, a scale per "
                                              "output channel, quantized at load")
    kv_cache_dtype: str = _flag("auto", "the KV pool's dtype: fp8 (e4m3) or auto (the model's)")
    num_speculative_tokens: int = _flag(0, "drafts checked per decode step (0: off; at most 15)")
    async_scheduling: bool = _flag(True, "launch each step before the last one's tokens are "
                                         "read back", "--no-async-scheduling")
    part_one: bool = _flag(False, "run part one's engine alone, as nanoserve.py's part one reads")
    # -- server settings --
    host: str = _flag("127.0.0.1", "address the server binds to")
    port: int = _flag(8000, "port the server listens on")
    api_key: Optional[str] = _flag(None, "require 'Authorization: Bearer KEY' "
                                         "(default: $NANOSERVE_API_KEY)")
    max_request_bytes: int = _flag(16 * 2**20, "largest request body the server reads (413 "
                                                "beyond; part one's server has no limit)")
    tool_call_parser: str = _flag("auto", "the format of the model's tool calls: hermes, llama3 "
                                          "or mistral (auto: read from its chat template)")
    # -- architecture, read from config.json (never flags) --
    vocab_size: int = field(init=False, default=0)
    hidden_size: int = field(init=False, default=0)            # D
    intermediate_size: int = field(init=False, default=0)      # I
    num_layers: int = field(init=False, default=0)
    num_heads: int = field(init=False, default=0)              # n_heads
    num_kv_heads: int = field(init=False, default=0)  # n_kv, <= n_heads: grouped-query attention
    head_dim: int = field(init=False, default=0)               # hd
    rms_norm_eps: float = field(init=False, default=1e-5)
    rope_theta: float = field(init=False, default=10000.0)
    rope_scaling: Optional[dict] = field(init=False, default=None)  # llama3 keys or None
    tie_word_embeddings: bool = field(init=False, default=False)    # lm_head = embed_tokens
    qkv_bias: bool = field(init=False, default=False)   # Qwen2: q, k and v projections add a bias
    qk_norm: bool = field(init=False, default=False)    # Qwen3: RMSNorm over each head of q and k
    eos_token_ids: list = field(init=False, default_factory=list)   # any of them ends a sequence

    def __post_init__(self):
        path = Path(self.model)
        if not (path / "config.json").is_file():
            how = "run `python download.py`" if self.model == DEFAULT_MODEL else \
                "`python download.py ORG/NAME` puts a hub model in weights/NAME"
            raise ValueError(f"model path {self.model!r} does not exist or has no config.json "
                             f"({how})")
        self._read_model_config(json.loads((path / "config.json").read_text()))
        if self.device == "auto":
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        on_cuda = self.device.startswith("cuda")
        if self.dtype == "auto":
            self.dtype = "bfloat16" if on_cuda else "float32"
        if self.attention == "auto":
            self.attention = "triton" if on_cuda else "sdpa"
        self.api_key = self.api_key or os.environ.get("NANOSERVE_API_KEY") or None
        self._check()

    def _read_model_config(self, c: dict):
        family = c.get("model_type", "llama")
        if family not in ("llama", "mistral", "qwen2", "qwen3"):
            raise ValueError(f"model_type {family!r} is unsupported (llama, mistral, qwen2, qwen3)")
        if "quantization_config" in c:      # its bytes are not bf16: never load them as such
            q = c["quantization_config"]
            raise ValueError(f"checkpoint stored quantized ({q.get('quant_method')}, format "
                             f"{q.get('format')!r}) is not supported: load its bf16 original, "
                             f"with --quantization fp8 for fp8 weights")
        self.vocab_size, self.hidden_size = c["vocab_size"], c["hidden_size"]
        self.intermediate_size, self.num_layers = c["intermediate_size"], c["num_hidden_layers"]
        self.num_heads = c["num_attention_heads"]
        self.num_kv_heads = c.get("num_key_value_heads") or self.num_heads
        self.head_dim = c.get("head_dim") or self.hidden_size // self.num_heads
        self.rms_norm_eps = c.get("rms_norm_eps", 1e-5)
        # transformers 5 writes "rope_parameters", older configs "rope_theta" and "rope_scaling".
        rope = dict(c.get("rope_parameters") or c.get("rope_scaling") or {})
        self.rope_theta = rope.pop("rope_theta", c.get("rope_theta", 10000.0))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", "llama3"):
            raise ValueError(f"rope type {rope_type!r} is not supported (default or llama3)")
        self.rope_scaling = rope if rope_type == "llama3" else None
        self.tie_word_embeddings = c.get("tie_word_embeddings", False)
        self.qkv_bias, self.qk_norm = family == "qwen2", family == "qwen3"
        limit = c.get("max_position_embeddings", 2048)
        self.max_model_len = min(self.max_model_len or limit, limit)
        # Mistral: a query sees only the last sliding_window keys. Qwen2 and Qwen3 turn that off.
        window = c.get("sliding_window") if c.get("use_sliding_window", True) else None
        if window and window < self.max_model_len:
            raise ValueError(f"sliding_window {window} is unsupported: serve at most that "
                             f"(--max-model-len {window})")
        eos = c.get("eos_token_id")
        self.eos_token_ids = [eos] if isinstance(eos, int) else list(eos or [])

    def _check(self):
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError("max_num_batched_tokens must be >= max_num_seqs, "
                             "so that every running sequence can decode in one step")
        for name, allowed in [("attention", ("triton", "sdpa", "torch")),
                              ("dtype", ("float32", "bfloat16", "float16")),
                              ("tool_call_parser", ("auto", "hermes", "llama3", "mistral")),
                              ("quantization", (None, "fp8")), ("kv_cache_dtype", ("auto", "fp8"))]:
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")
        if self.attention == "triton" and not self.device.startswith("cuda") \
                and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError("the triton attention needs cuda (or TRITON_INTERPRET=1)")
        # Part one's engine acts on none of these: run with it, they are refused, not ignored (a
        # pool and weights in the model's dtype, no drafts, one GPU, no API key or body limit, no
        # tool calls, where the user asked else). Three more are on by default and off in part one
        # (enable_prefix_caching, async_scheduling, CUDA graphs): it runs without them, as the
        # plain engine it is.
        for name in ("kv_cache_dtype", "quantization", "num_speculative_tokens",
                     "tensor_parallel_size", "api_key", "max_request_bytes", "tool_call_parser"):
            if self.part_one and getattr(self, name) != self.__dataclass_fields__[name].default:
                env = name == "api_key" and self.api_key == os.environ.get("NANOSERVE_API_KEY")
                raise ValueError(f"part one's engine (--part-one) has no {name}: leave it at "
                                 f"its default{' (unset $NANOSERVE_API_KEY)' if env else ''}, "
                                 f"or leave out --part-one")

    torch_dtype = property(lambda self: getattr(torch, self.dtype))

# ---------------------------------------------------------------------------
# Loader
# Checkpoints use Hugging Face names. The engine's names drop "model." and say "attn" for
# "self_attn". The engine also fuses q, k and v into one matmul, and gate and up into another, so
# those tensors land in row slices of the fused weight.

def engine_name(key: str, cfg: Config) -> tuple[str, slice]:
    """Where a checkpoint tensor lands: (engine parameter, row slice of it)."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    i = cfg.intermediate_size                                  # I
    fused = {"q_proj": ("qkv_proj", slice(0, q)), "k_proj": ("qkv_proj", slice(q, q + kv)),
             "v_proj": ("qkv_proj", slice(q + kv, q + 2 * kv)),
             "gate_proj": ("gate_up_proj", slice(0, i)),
             "up_proj": ("gate_up_proj", slice(i, 2 * i))}
    *module, proj, kind = key.removeprefix("model.").replace("self_attn.", "attn.").split(".")
    if proj in fused:                # layers.3.attn.k_proj.weight -> layers.3.attn.qkv_proj.weight
        return ".".join([*module, fused[proj][0], kind]), fused[proj][1]
    return ".".join([*module, proj, kind]), slice(None)

def _progress(msg: str, end: bool = False):
    """One updating status line on stderr (a plain line when not a terminal)."""
    if sys.stderr.isatty():
        print(f"\r{msg}", end="\n" if end else "", file=sys.stderr, flush=True)
    elif end:
        print(msg, file=sys.stderr, flush=True)

def read_checkpoint(cfg: Config):
    """Each tensor of the checkpoint in cfg.model, as (its Hugging Face name, the tensor)."""
    from safetensors import safe_open
    index = Path(cfg.model, "model.safetensors.index.json")   # as transformers: not consolidated.*
    names = json.loads(index.read_text())["weight_map"].values() if index.is_file() else []
    for name in sorted({*names} or {"model.safetensors"}):
        with safe_open(str(Path(cfg.model, name)), framework="pt", device="cpu") as f:
            for key in f.keys():
                yield key, f.get_tensor(key)

@torch.no_grad()
def load_weights(model: nn.Module, cfg: Config, tensors):
    """Copy each of `tensors` (read_checkpoint's pairs) into its slice; fail on anything missing
    or extra."""
    params, num_done = dict(model.named_parameters()), 0
    num_rows_loaded = dict.fromkeys(params, 0)
    for key, tensor in tensors:
        if "rotary_emb" in key or (key == "lm_head.weight" and cfg.tie_word_embeddings):
            continue  # derived from the config / tied to the embedding
        target, rows = engine_name(key, cfg)
        if target not in params:
            raise ValueError(f"unexpected tensor {key!r} in {cfg.model}")
        params[target].data[rows].copy_(tensor)  # copy_ casts to the engine dtype
        num_rows_loaded[target] += tensor.shape[0]
        num_done += 1
        _progress(f"loading weights: {num_done} tensors")
    _progress(f"loaded {num_done} tensors", end=True)
    missing = [n for n, p in params.items() if num_rows_loaded[n] != p.shape[0]]
    if missing:
        raise ValueError(f"checkpoint is missing {missing[:3]}{'...' if len(missing) > 3 else ''}")

# ---------------------------------------------------------------------------
# Layers
# RMSNorm, rotary embeddings (with Llama-3 frequency scaling), GQA attention over the paged cache,
# and the SwiGLU MLP. Every layer works on a flat batch of tokens (N_tok, D): sequence boundaries
# live only in AttentionMetadata. Read each pa.* call by its contract, a torch reference in
# paged_attention.py's first section. Five matter here: rms_norm_ref (pa.norm), gemv_ref
# (pa.linear), rope_store_kvcache_ref (rotate q and k, write K/V into the pool; as_stored is x
# itself but in an fp8 pool), and paged_attention_decode_ref and _prefill_ref (attention over
# the pool: _gather_kv_ref reads a sequence's K/V, _attend_ref attends over them).
# pa.linear(x, w, norm=, silu_mul=, residual=, bias=) computes residual + F.linear(f(x), w) +
# bias, f the norm or SiLU-and-mul, whichever kernel runs. It takes the norm and the residual so
# that a kernel that reads the weight can do all of it in one pass, so Attention and MLP take
# their block's norm and residual. pa.ATTENTION, at that file's end, gives each attention's
# rope_store, and an attend that runs the decode function when meta.is_decode, else the prefill:
#     cfg.attention   rope_store                     attend (decode, prefill)
#     "triton"        rope_store_kvcache (a kernel)  paged_attention_decode, _prefill (kernels)
#     "sdpa" (CPU)    rope_store_kvcache_ref, whose  paged_attention_decode_sdpa, _prefill_sdpa
#                     store is store_kvcache_sdpa
#     "torch"         rope_store_kvcache_ref         paged_attention_decode_ref, _prefill_ref
# The references are the contract; the other two are tested equal to them.

class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps, self.weight = eps, nn.Parameter(torch.ones(dim))  # weight: (D,)

    def forward(self, x):                                      # (N_tok, D)
        """weight * x / sqrt(mean(x^2) + eps), normalized in fp32 (bf16 squares would lose bits) and
        cast back before the weight as transformers does, so bf16 rounds alike (pa.rms_norm_ref)."""
        return pa.norm(x, self.weight, self.eps)

def rope_inv_freq(cfg: Config) -> torch.Tensor:
    """Rotation frequency of each channel pair, with llama3 scaling if configured."""
    hd = cfg.head_dim
    inv_freq = 1.0 / cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    if (s := cfg.rope_scaling) is None:
        return inv_freq.float()                                # (hd/2,)
    # Llama 3 stretches long wavelengths by `factor`, keeps short ones, blends smoothly in between,
    # so a model trained on original_max_position_embeddings tokens extrapolates to longer contexts.
    old_len, factor = s["original_max_position_embeddings"], s["factor"]
    low, high = s["low_freq_factor"], s["high_freq_factor"]
    wavelen = 2 * math.pi / inv_freq                       # (hd/2,) tokens per full turn
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)  # long: stretched
    # between the bands, a mix of the stretched and the kept frequency: smooth is 0 at the long
    # band's edge (all stretched) and 1 at the short band's (all kept)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)  # (hd/2,) bool
    return torch.where(medium, blended, scaled).float()        # (hd/2,)

class RotaryEmbedding(nn.Module):
    """cos and sin of every position times every channel pair's frequency, precomputed; Attention's
    rope_store rotates (pa.rope_ref), with the triton attention fused with the KV write
    (pa.rope_store_kvcache)."""
    def __init__(self, cfg: Config):
        super().__init__()
        t = torch.arange(cfg.max_model_len, dtype=torch.float32)  # (max_model_len,) positions
        freqs = torch.outer(t, rope_inv_freq(cfg))             # (max_model_len, hd/2)
        self.register_buffer("cos", freqs.cos(), persistent=False)
        self.register_buffer("sin", freqs.sin(), persistent=False)

@dataclass
class AttentionMetadata:
    """Where a step's sequences live in the flat batch and in the KV pool; ModelRunner.prepare
    fills it. By example: block_size 4, one sequence of 6 tokens whose last 2 are new this step,
    its K/V in pool blocks 7 and 2 (its block_table).
        block_tables  each sequence's block_table, a row each: [[7, 2]]
        slot_mapping  the pool slot each new token's K/V is written to, block_id * block_size
                      + offset: tokens 4 and 5 go to 2 * 4 + 0 = 8 and 9 (-1: a padding token)
        context_lens  tokens in the cache once this step has run: [6]
        cu_seqlens_q  where each sequence's new tokens start among the step's N_tok: [0, 2]"""
    slot_mapping: torch.Tensor        # (N_tok,) int64
    block_tables: torch.Tensor        # (B, max_blocks) int32, max_blocks: the table's width
    context_lens: torch.Tensor        # (B,) int32, tokens in the cache after this step
    cu_seqlens_q: torch.Tensor        # (B+1,) int32, start of each sequence in N_tok
    is_decode: bool                   # every sequence brings exactly one new token

class Attention(nn.Module):
    """Grouped-query attention: n_heads query heads share n_kv K/V heads."""
    def __init__(self, cfg: Config):
        super().__init__()
        self.n_heads, self.n_kv, self.hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q_size, kv_size = self.n_heads * self.hd, self.n_kv * self.hd
        self.split_sizes = [q_size, kv_size, kv_size]      # the rows of q, k, v in qkv_proj
        self.qkv_proj = nn.Linear(cfg.hidden_size, q_size + 2 * kv_size, bias=cfg.qkv_bias)  # Qwen2
        self.o_proj = nn.Linear(q_size, cfg.hidden_size, bias=False)
        self.q_norm = self.k_norm = None                   # Qwen3's RMSNorm over each head of q
        if cfg.qk_norm:                                    # and k, before RoPE (in rope_store)
            self.q_norm = RMSNorm(self.hd, cfg.rms_norm_eps)   # weights (hd,), shared by heads
            self.k_norm = RMSNorm(self.hd, cfg.rms_norm_eps)
        self.scale = self.hd ** -0.5                       # softmax(q k^T / sqrt(hd))
        # triton, sdpa (the CPU path) or the torch references (pa.ATTENTION)
        self.rope_store, self.attend = pa.ATTENTION[cfg.attention]
        # This layer's slice of the KV pool, set by ModelRunner._bind_kv_cache.
        self.k_cache = self.v_cache = None    # (num_blocks, block_size, n_kv, hd)

    def forward(self, x, positions, rope, meta: AttentionMetadata, norm=None, residual=None):
        """residual + attention(norm(x)), norm and residual optional."""
        n = x.shape[0]
        qkv = pa.linear(x, self.qkv_proj.weight, norm=norm,
                        bias=self.qkv_proj.bias)           # (N_tok, (n_heads + 2 n_kv) hd) Qwen2
        q, k, v = (t.view(n, -1, self.hd) for t in qkv.split(self.split_sizes, dim=-1))
        # Rotate q (in place) and k by their positions, and write this step's K/V into
        # the pool first: attention then reads every key, old and new, from one place.
        self.rope_store(q, k, v, self.k_cache, self.v_cache, meta.slot_mapping, positions,
                        rope.cos, rope.sin, self.q_norm, self.k_norm)
        o = self.attend(q, self.k_cache, self.v_cache, meta, self.scale)  # (N_tok, n_heads, hd)
        return pa.linear(o.reshape(n, self.n_heads * self.hd), self.o_proj.weight,
                         residual=residual)                    # (N_tok, D)

class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), with gate and up fused in one matmul."""
    def __init__(self, cfg: Config):
        super().__init__()
        I = cfg.intermediate_size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * I, bias=False)
        self.down_proj = nn.Linear(I, cfg.hidden_size, bias=False)

    def forward(self, x, norm=None, residual=None):           # (N_tok, D)
        """residual + mlp(norm(x)), norm and residual optional."""
        gate_up = pa.linear(x, self.gate_up_proj.weight, norm=norm)   # (N_tok, 2 I)
        return pa.linear(gate_up, self.down_proj.weight, silu_mul=True,
                         residual=residual)                    # (N_tok, D)

class DecoderLayer(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, positions, rope, meta):               # (N_tok, D)
        """transformers' pre-norm block: h = x + attn(norm(x)), then h + mlp(norm(h))."""
        h = self.attn(x, positions, rope, meta, norm=self.input_layernorm, residual=x)
        return self.mlp(h, norm=self.post_attention_layernorm, residual=h)

# ---------------------------------------------------------------------------
# Model
# Embedding -> decoder layers -> final norm -> LM head. forward() returns the residual stream of
# every token. compute_logits() applies the final norm and the LM head, through pa.linear, to the
# rows it is given. ModelRunner.head gives it only the rows that sample: each sequence's last
# token, once all its tokens are computed (its prompt, and after a preemption its output so far).

class Model(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.rope = RotaryEmbedding(cfg)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def forward(self, input_ids, positions, meta: AttentionMetadata):  # (N_tok,), (N_tok,)
        x = self.embed_tokens(input_ids)                       # (N_tok, D)
        for layer in self.layers:
            x = layer(x, positions, self.rope, meta)       # (N_tok, D)
        return x                                               # (N_tok, D), before the final norm

    def compute_logits(self, hidden):                          # (B, D)
        w = self.embed_tokens.weight if self.cfg.tie_word_embeddings else self.lm_head.weight
        return pa.linear(hidden, w, norm=self.norm)            # (B, V)

def build_model(cfg: Config, tensors=None) -> Model:
    """Allocate the model on its device without a throwaway random init, then load `tensors`,
    by default the checkpoint's (read_checkpoint)."""
    with torch.device("meta"):
        model = Model(cfg)
    model = model.to(cfg.torch_dtype).to_empty(device=cfg.device)  # memory, not values
    model.rope = RotaryEmbedding(cfg).to(cfg.device)           # buffers were meta; recompute
    load_weights(model, cfg, read_checkpoint(cfg) if tensors is None else tensors)
    return model.eval()

# ---------------------------------------------------------------------------
# Sampler
# One pass over the whole batch's logits: greedy, or temperature, top-k and top-p sampling (each
# of pa's steps has a torch contract in paged_attention.py's first section). Each row carries
# its own settings, so one request's choices never change another's. A seeded row draws its noise
# from its own generator, seeded anew for each token by the request's seed and the token's
# position (ModelRunner.sampling_batch hashes the two). So a draw depends on nothing else: not
# the batch, nor which steps ran before. Sampling never makes the host wait for the device (no
# sync; the torch references of attention do, on CUDA: they are the tests' contracts, not a path
# to run). A step's one wait is EngineCore._read_back's.

@dataclass
class SamplingParams:
    temperature: float = _flag(1.0, "0 is greedy; higher is more random")
    top_p: float = _flag(1.0, "sample from the smallest top set with this much mass")
    top_k: int = _flag(-1, "sample from the k likeliest tokens (-1: all)")
    max_tokens: int = _flag(16, "most tokens to generate")
    stop_token_ids: Optional[list] = None  # token ids that end the sequence
    ignore_eos: bool = _flag(False, "keep generating past the end-of-sequence token")
    seed: Optional[int] = _flag(None, "same seed, same random draws, whatever else is in the batch")

    def __post_init__(self):
        self.stop_token_ids = list(self.stop_token_ids or [])

# The end of the file rebinds the name SamplingParams to the default engine's, which carries more
# fields; FrontEnd.validate refuses those under --part-one (these are part one's).
PART_ONE_SAMPLING_FIELDS = [f.name for f in dataclasses.fields(SamplingParams)]

@dataclass
class SamplingBatch:
    """A step's per-row settings as device tensors; host flags let the sampler skip unasked work."""
    # In an all-greedy batch (all_greedy) the three tensors are None: a greedy row needs none.
    temperatures: Optional[torch.Tensor]  # (B,) float, 0 for greedy rows
    top_ks: Optional[torch.Tensor]    # (B,) int, V where top-k is off
    top_ps: Optional[torch.Tensor]    # (B,) float
    generators: list                  # (row, torch.Generator, hash(seed, position)), seeded rows
    all_greedy: bool
    needs_top_k_top_p: bool

def sample(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:   # (B, V)
    """Return the sampled token ids (B,)."""
    tokens = pa.argmax_rows(logits)          # (B,), the greedy choice (logits in any dtype)
    if not batch.all_greedy:
        t = batch.temperatures.unsqueeze(1)                # (B, 1)
        scaled = logits.float() / torch.where(t > 0, t, 1.0)   # a greedy row's draw is replaced
        if batch.needs_top_k_top_p:
            scaled = pa.apply_top_k_top_p(scaled, batch.top_ks, batch.top_ps)
        probs = scaled.softmax(dim=-1)                     # (B, V)
        # Exponential race ("sample without a CUDA sync"). Draw E_i ~ Exp(1) for each token. Token
        # i wins when E_i / p_i is the smallest, which happens with probability exactly p_i (the
        # minimum of exponentials with rates p_i). So argmax(p / E) is a draw from p. Unlike
        # torch.multinomial, it needs no host round trip, and it takes a per-row generator.
        noise = torch.empty_like(probs).exponential_()
        for row, gen, seed in batch.generators:
            noise[row].exponential_(generator=gen.manual_seed(seed))
        sampled = (probs / noise).argmax(dim=-1)           # (B,)
        tokens = torch.where(batch.temperatures > 0, sampled, tokens)
    return tokens

# ---------------------------------------------------------------------------
# Block allocator
# The KV pool is cut into blocks of block_size tokens. A sequence holds the blocks its tokens'
# K/V fill (its block_table). A block has a reference count, the sequences using it, so that a
# block can one day be shared; in part one it is 0 or 1. A block whose count drops to 0 goes back
# to the free list.

class BlockAllocator:
    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks                 # sequences using each block
        self.free_block_ids = deque(range(num_blocks))   # ref 0; the scheduler takes from the front

    num_free_blocks = property(lambda self: len(self.free_block_ids))

    def allocate(self) -> int:
        """A free block, its count set to 1. The scheduler checks num_free_blocks first."""
        block = self.free_block_ids.popleft()
        assert self.ref_counts[block] == 0, f"block {block} allocated while in use"
        self.ref_counts[block] = 1
        return block

    def free(self, block: int):
        assert self.ref_counts[block] > 0, f"block {block} freed twice"
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            self.free_block_ids.append(block)

# ---------------------------------------------------------------------------
# Scheduler
# Every step the scheduler decides which sequences run and how many of their tokens. Running
# sequences go first. Skipping a decode would stall its stream for a whole step, and would save
# only one token of the budget. An unfinished prefill takes a chunk of the budget. Waiting
# sequences come next, in arrival order; a preempted one is first in line. They are admitted
# while the budget, the seats (max_num_seqs) and the free blocks last. A prompt that does not fit
# takes what is left of the budget as a chunk, and the budget is then spent: so a step holds at
# most one unfinished prefill chunk, its last sequence.
# When the pool runs dry, the latest admitted sequence is preempted: freed, and recomputed later.
# That may be the sequence asking, a running prefill among them: its computed chunks are dropped
# with its blocks, where a waiting prompt that does not fit is only left waiting (_admit).
# A run by example (test_scheduler_runs_as_its_example): block_size 4, a pool of 5 blocks, a
# budget of 8 tokens. A (a 10-token prompt) asks for 6 tokens, B (5 tokens) for 4.
#   step 0     A's first chunk, 8 tokens in 2 blocks: the budget is spent, and B waits (3 free)
#   step 1     A's last 2 prompt tokens (a 3rd block) and B's whole prompt (2 blocks): both
#              sample, and the pool is full (0 free)
#   steps 2-3  both decode in the blocks they hold (after step 3, A has 12 tokens computed in
#              its 3 blocks, B 7 in its 2)
#   step 4     A needs a 4th block: B, admitted last, is preempted (its blocks freed, its computed
#              count back to 0, first in line again), and A decodes alone (1 free)
#   steps 5-6  A decodes, and B waits: its 8 tokens need 2 blocks. Step 6 samples A's 6th token
#              ("length"), and its 4 blocks are freed (5 free)
#   step 7     B is admitted again and recomputes its 8 tokens (5 of prompt, 3 of output) in one
#              chunk, whose last row samples its 4th token ("length")

class Sequence:
    """One request as the engine core sees it: token ids (never text), cache blocks, progress.
    Between steps a decoding sequence's counts satisfy num_computed_tokens == len(token_ids) - 1:
    every token but the newest is in the cache, and the newest is the input of its next step. A
    prefill, or a recompute after a preemption, has fewer computed until its last chunk."""
    def __init__(self, request_id: str, prompt_token_ids: list, params: SamplingParams):
        self.request_id, self.params = request_id, params
        self.token_ids = list(prompt_token_ids)        # prompt + output so far
        self.num_prompt_tokens = len(prompt_token_ids)     # fixed: output starts after these
        self.num_computed_tokens = 0     # tokens launched: their K/V in the cache, or on the way
        self.block_table: list[int] = []                   # logical block i -> pool block id
        self.status, self.finish_reason = "waiting", None   # "running" (back to "waiting" if
                                                            # preempted), then "finished"
        self.generator = None            # per-request RNG when params.seed is set (Sampler)
    num_tokens = property(lambda self: len(self.token_ids))
    num_output_tokens = property(lambda self: len(self.token_ids) - self.num_prompt_tokens)
    is_finished = property(lambda self: self.status == "finished")

@dataclass
class ScheduledBatch:
    """What one step runs: each sequence with its number of new tokens."""
    seqs: list
    num_new_tokens: list
    is_decode = property(lambda self: set(self.num_new_tokens) == {1})

class Scheduler:
    def __init__(self, cfg: Config, allocator: BlockAllocator):
        self.cfg, self.allocator, self.block_size = cfg, allocator, cfg.block_size
        self.waiting: deque[Sequence] = deque()            # FIFO; a preempted one goes first
        self.running: list[Sequence] = []      # in admission order
        self.num_preemptions = 0                 # a step that preempts admits no one

    def schedule(self) -> ScheduledBatch:
        batch, budget = ScheduledBatch([], []), self.cfg.max_num_batched_tokens
        num_preemptions_before = self.num_preemptions
        budget = self._schedule_running(batch, budget, list(self.running))
        # -- admit waiting sequences while budget, seats and blocks allow --
        # (not in a step that had to preempt: the pool is already too full)
        while self.waiting and budget > 0 and len(self.running) < self.cfg.max_num_seqs \
                and self.num_preemptions == num_preemptions_before:
            seq = self.waiting[0]
            n = self._admit(seq, budget)
            if n == 0:                         # too few free blocks: retry next step
                break
            batch.seqs.append(seq), batch.num_new_tokens.append(n)
            budget -= n
        return batch

    def _schedule_running(self, batch: ScheduledBatch, budget: int, seqs: list) -> int:
        """Running sequences first, in admission order: decodes, and unfinished prefill chunks.
        seqs is a copy of running, since _reserve_blocks may preempt from its back. Returns the
        budget left."""
        for seq in seqs:
            if budget == 0:
                break
            if seq.status != "running":        # preempted earlier in this loop
                continue
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)   # a prompt's rest, or 1
            if self._reserve_blocks(seq, n):
                batch.seqs.append(seq), batch.num_new_tokens.append(n)
                budget -= n
        return budget

    def _admit(self, seq: Sequence, budget: int) -> int:
        """Move the first waiting sequence to running with blocks for up to `budget` of its tokens;
        return how many it runs, or 0 if the free blocks are too few (it stays first in line)."""
        n = min(seq.num_tokens - seq.num_computed_tokens, budget)
        if self._num_blocks_needed(seq, n) > self.allocator.num_free_blocks:
            return 0
        self._reserve_blocks(seq, n)
        self.waiting.popleft()
        seq.status = "running"
        self.running.append(seq)
        return n

    def _num_blocks_needed(self, seq: Sequence, n: int) -> int:
        total = -(-(seq.num_computed_tokens + n) // self.block_size)  # ceil
        return max(0, total - len(seq.block_table))

    def _reserve_blocks(self, seq: Sequence, n: int) -> bool:
        """Give seq blocks for n more tokens, preempting from the back of running as needed; False
        if seq itself was preempted. A victim is never in the batch being built: schedule walks
        running from the front, victims come from the back, behind seq (and schedule skips one it
        reaches). Admission only reserves blocks it has checked are free, so it never preempts."""
        needed = self._num_blocks_needed(seq, n)           # 0 while the last block has room
        while needed > self.allocator.num_free_blocks:
            victim = self.running[-1]                      # the most recently admitted
            self._preempt(victim)
            if victim is seq:
                return False
        seq.block_table += [self.allocator.allocate() for _ in range(needed)]
        return True

    def _preempt(self, seq: Sequence):
        """Recompute-style preemption: drop the KV, keep the tokens, requeue first."""
        self.running.remove(seq)
        self._free_blocks(seq)
        seq.status = "waiting"
        self.waiting.appendleft(seq)               # first in line: it was admitted before the rest
        self.num_preemptions += 1

    def _free_blocks(self, seq: Sequence):
        for block in reversed(seq.block_table):   # tail first
            self.allocator.free(block)
        seq.block_table, seq.num_computed_tokens = [], 0

    def finish(self, seq: Sequence, reason: str):
        (self.running if seq.status == "running" else self.waiting).remove(seq)
        self._free_blocks(seq)
        seq.status, seq.finish_reason = "finished", reason

# ---------------------------------------------------------------------------
# Model runner
# Turns a scheduled batch into flat tensors, runs the model and samples. Each step copies its
# inputs into static buffers (self.buffers), allocated once at their largest, and the forward pass
# reads them there: the forward pass's inputs take no new device memory, and always sit at the
# same addresses. The calls, per step: launch -> prepare (_flatten the batch into host lists;
# _put_input_ids and put_step copy them into the buffers) -> forward -> head (the LM head's
# logits); then sample -> draw -> copy_to_host, which EngineCore._read_back waits for. Before any step, __init__ sizes the KV
# pool (allocate_kv_cache: on the GPU, what profile_peak_bytes leaves).
# Three CUDA words. Pinned memory is host memory the GPU can copy to and from directly. A
# non_blocking copy between it and the GPU is queued on the stream, and the host goes on at
# once. A CUDA event, recorded on the stream, marks a point in its queue; event.synchronize()
# waits for that point.

@dataclass
class StepInputs:
    """A batch flattened into the buffers (prepare)."""
    input_ids: torch.Tensor           # (N_tok,) int64
    positions: torch.Tensor           # (N_tok,) int64, each token's position in its sequence
    meta: AttentionMetadata
    num_tokens: int                   # the real tokens: N_tok here
    samples: list                     # (row, seq) of each row that samples (_flatten says which)
    sample_positions: list            # the position of the token each one draws (seeds)

@dataclass
class LaunchedStep:
    """A step on the device, its whole life. ModelRunner.launch queues its forward pass and
    logits. ModelRunner.sample samples it and starts the tokens' copy to the host, which
    EngineCore._commit waits for."""
    batch: ScheduledBatch
    seqs: list                        # the sequences that sample, in row order
    logits: Optional[torch.Tensor]    # (B, V) of those rows
    sample_positions: list = field(default_factory=list)   # of the tokens they draw
    tokens: Optional[torch.Tensor] = None     # (B,) int64 on the device, once sampled
    host: list = field(default_factory=list)  # host copies read back (part one: the tokens)
    copied: Optional[torch.cuda.Event] = None   # done once `host` is filled (None on CPU)

class ModelRunner:
    def __init__(self, cfg: Config):
        self.cfg, self.device = cfg, torch.device(cfg.device)
        self.use_cuda = self.device.type == "cuda"
        if self.device.type == "cpu":        # torch's threads, for every thread of this process
            pa.set_cpu_threads(cfg.num_threads)
        self.model = self.load_model()
        self.max_blocks_per_seq = -(-cfg.max_model_len // cfg.block_size)
        S, T, dev = cfg.max_num_seqs, cfg.max_num_batched_tokens, self.device
        self.buffers = dict(
            input_ids=torch.zeros(T, dtype=torch.int64, device=dev),
            positions=torch.zeros(T, dtype=torch.int64, device=dev),
            slot_mapping=torch.full((T,), -1, dtype=torch.int64, device=dev),
            context_lens=torch.zeros(S, dtype=torch.int32, device=dev),
            cu_seqlens_q=torch.zeros(S + 1, dtype=torch.int32, device=dev),
            block_tables=torch.zeros(S, self.max_blocks_per_seq, dtype=torch.int32, device=dev))
        self.num_blocks = self.allocate_kv_cache()

    def load_model(self) -> Model:
        return build_model(self.cfg)

    def close(self):
        """Release what the runner holds beyond its memory: nothing, in part one."""

    # -- KV pool --
    @property
    def kv_cache_dtype(self) -> torch.dtype:
        """The dtype of the keys and values in the pool: the model's."""
        return self.cfg.torch_dtype

    def _bind_kv_cache(self, num_blocks: int):
        cfg, n_kv = self.cfg, self.model.layers[0].attn.n_kv
        kv = torch.empty(2, cfg.num_layers, num_blocks, cfg.block_size, n_kv, cfg.head_dim,
                         dtype=self.kv_cache_dtype, device=self.device)
        for layer, k, v in zip(self.model.layers, *kv):   # each (num_blocks, block_size, n_kv, hd)
            layer.attn.k_cache, layer.attn.v_cache = k, v

    def num_kv_blocks(self) -> int:
        """The pool's size: cfg.num_blocks, else as many blocks as the memory left holds."""
        cfg = self.cfg
        block_bytes = (2 * cfg.num_layers * cfg.block_size * self.model.layers[0].attn.n_kv
                       * cfg.head_dim * self.kv_cache_dtype.itemsize)
        if cfg.num_blocks:
            return cfg.num_blocks
        if self.use_cuda:
            # The KV pool gets what the profiled peak (weights and the largest step) leaves.
            total = torch.cuda.get_device_properties(self.device).total_memory
            return int((total * cfg.gpu_memory_utilization - self.profile_peak_bytes())
                       // block_bytes)
        return int(cfg.cpu_kv_cache_gb * 1e9 // block_bytes)

    def allocate_kv_cache(self) -> int:
        num_blocks, cfg = self.num_kv_blocks(), self.cfg
        if num_blocks < 1:
            raise ValueError("no memory left for the KV cache: lower max_num_batched_tokens "
                             "or raise gpu_memory_utilization (on cpu: cpu_kv_cache_gb)")
        self._bind_kv_cache(num_blocks)
        _progress(f"KV cache: {num_blocks} blocks of {cfg.block_size} tokens, "
                  f"{num_blocks * cfg.block_size} tokens, {self.kv_cache_dtype}", end=True)
        return num_blocks

    @torch.no_grad()
    def profile_peak_bytes(self) -> int:
        """(The GPU's sizing: skip it on a first reading.) The peak of GPU memory allocated (the
        weights, the buffers and the largest step's activations), measured by running that step
        once on a dummy batch of its tokens (max_num_batched_tokens, or what max_num_seqs
        sequences of max_model_len hold if that is fewer), plus room for the sampler's sort."""
        cfg, L = self.cfg, self.cfg.max_model_len
        n = min(cfg.max_num_batched_tokens, cfg.max_num_seqs * L)   # the largest step's tokens
        seqs = [Sequence("profile", [0] * min(L, n - i), SamplingParams()) for i in range(0, n, L)]
        blocks = iter(range(n // cfg.block_size + len(seqs)))     # enough for every sequence
        for seq in seqs:
            seq.block_table = [next(blocks) for _ in range(-(-seq.num_tokens // cfg.block_size))]
        self._bind_kv_cache(n // cfg.block_size + len(seqs))
        torch.cuda.reset_peak_memory_stats(self.device)
        self.sample(self.launch(ScheduledBatch(seqs, [seq.num_tokens for seq in seqs])))
        torch.cuda.synchronize(self.device)
        # the sampler's peak grows with the batch: allow a full-vocab sort per row
        sampler_bytes = 4 * cfg.max_num_seqs * cfg.vocab_size * 4
        peak = torch.cuda.max_memory_allocated(self.device) + sampler_bytes
        self._bind_kv_cache(0)
        torch.cuda.empty_cache()
        return peak

    # -- inputs --
    def prepare(self, batch: ScheduledBatch) -> StepInputs:
        """The step's inputs in the static buffers: the batch flattened (_flatten), then copied.
        A worked step, block_size 16, a budget of 41 tokens: B (71 tokens, blocks [2, 5, 8, 6,
        1]) decodes position 70; A (a 100-token prompt, 16 of them computed in an earlier step,
        blocks [7, 3, 9, 4]) takes the 40 left (positions 16-55).
            input_ids     B's token 70, then A's tokens 16..55
            positions     70, 16, 17, .., 55
            slot_mapping  22 (block 1), 48..63 (block 3), 144..159 (block 9), 64..71 (block 4)
            context_lens  [71, 56]: each sequence's tokens in the cache once this step has run
            cu_seqlens_q  [0, 1, 41]: B owns row 0, A rows 1-40
            block_tables  [[2, 5, 8, 6, 1], [7, 3, 9, 4, 0]]: as wide as the longest, 0-padded
        Only row 0 samples: A's chunk is not its prompt's last (with a 56-token prompt, row 40
        would too)."""
        flat, samples = self._flatten(batch)
        num_tokens = len(flat["positions"])
        self._put_input_ids(batch, flat.pop("input_ids"))
        draws = [flat["positions"][row] + 1 for row, _ in samples]   # a row draws the next token
        inputs = self.put_step(flat, num_tokens, len(batch.seqs), flat["block_tables"].shape[1],
                               batch.is_decode)
        return StepInputs(*inputs, num_tokens, samples, draws)

    def _put_input_ids(self, batch: ScheduledBatch, input_ids: list):
        """The step's token ids into their buffer (put_step copies the other lists)."""
        pa.put(self.buffers["input_ids"], input_ids)

    def put_step(self, flat: dict, N: int, S: int, width: int, is_decode: bool) -> tuple:
        """The lists into the buffers: the model's inputs, N tokens of S sequences."""
        for name, values in flat.items():
            pa.put(self.buffers[name], values)
        b = self.buffers
        meta = AttentionMetadata(b["slot_mapping"][:N], b["block_tables"][:S, :width],
                                 b["context_lens"][:S], b["cu_seqlens_q"][:S + 1], is_decode)
        return b["input_ids"][:N], b["positions"][:N], meta

    def _flatten(self, batch: ScheduledBatch):
        """Each sequence's new tokens in turn, as host lists, one per buffer (block_tables as a
        numpy array). Also the rows that sample: a sequence's last, once all its tokens are
        computed (its prompt, and after a preemption its output so far)."""
        bs = self.cfg.block_size
        input_ids, positions, slot_mapping, context_lens, cu_seqlens_q = [], [], [], [], [0]
        samples, tables = [], []   # samples: (row, seq)
        width = max(len(seq.block_table) for seq in batch.seqs)
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
            input_ids += seq.token_ids[start:end]
            table = seq.block_table
            tables.append(table + [0] * (width - len(table)))   # the row's blocks, then 0s
            positions += range(start, end)
            slot_mapping += [table[p // bs] * bs + p % bs for p in range(start, end)]
            context_lens.append(end)
            cu_seqlens_q.append(cu_seqlens_q[-1] + n)
            if end == len(seq.token_ids):   # its last input is its newest token: it samples
                samples.append((cu_seqlens_q[-1] - 1, seq))
        flat = dict(input_ids=input_ids, positions=positions, slot_mapping=slot_mapping,
                    context_lens=context_lens, cu_seqlens_q=cu_seqlens_q,
                    block_tables=np.array(tables, dtype=np.int32))   # (B, width)
        return flat, samples

    def sampling_batch(self, seqs: list, positions: list) -> SamplingBatch:
        """The rows' settings; positions: of the token each row draws, which seeds its noise."""
        params, V = [s.params for s in seqs], self.cfg.vocab_size
        all_greedy = all(p.temperature == 0 for p in params)
        def per_row(value, dtype):            # an all-greedy batch needs no per-row tensors
            return None if all_greedy else pa.to_device(self.device, [*map(value, params)], dtype)
        return SamplingBatch(
            temperatures=per_row(lambda p: p.temperature, torch.float32),
            top_ks=per_row(lambda p: p.top_k if p.top_k > 0 else V, torch.int64),
            top_ps=per_row(lambda p: p.top_p, torch.float32),
            # hash of (seed, position): the same in every process (only str hashes are salted)
            generators=[(i, s.generator, hash((s.params.seed, positions[i])))
                        for i, s in enumerate(seqs) if s.generator is not None],
            needs_top_k_top_p=any(p.top_k > 0 or p.top_p < 1 for p in params),
            all_greedy=all_greedy)

    # -- forward and sample --
    def forward(self, input_ids, positions, meta: AttentionMetadata):
        """The model's forward pass over a step's inputs (in the buffers)."""
        return self.model(input_ids, positions, meta)          # (N_tok, D)

    @torch.no_grad()
    def launch(self, batch: ScheduledBatch) -> LaunchedStep:
        """Queue one step on the device: its forward pass, then the logits of the rows that
        sample."""
        inputs = self.prepare(batch)
        hidden = self.forward(inputs.input_ids, inputs.positions, inputs.meta)
        return self.head(batch, inputs, hidden[:inputs.num_tokens])

    def head(self, batch: ScheduledBatch, inputs: StepInputs, hidden) -> LaunchedStep:  # (N_tok, D)
        """The step's logits, the LM head's over the rows that sample only."""
        if not inputs.samples:                  # only unfinished prefill chunks this step
            return LaunchedStep(batch, [], None)
        rows, seqs = zip(*inputs.samples)
        if len(rows) < hidden.shape[0]:         # skip the rows of prefill tokens
            hidden = hidden.index_select(0, pa.to_device(self.device, rows, torch.int64))
        logits = self.model.compute_logits(hidden)                           # (B, V)
        return LaunchedStep(batch, list(seqs), logits, inputs.sample_positions)

    def sample(self, step: LaunchedStep):     # no grad: the logits have none
        """Sample a step's rows on the device and start their tokens' copy back, which _commit
        waits for."""
        if step.seqs:                      # else only unfinished prefill chunks: no logits
            step.tokens = self.draw(step.logits, step)
            self.copy_to_host(step, step.tokens)

    def draw(self, logits, step: LaunchedStep) -> torch.Tensor:   # (B, V) -> (B,)
        """The step's rows' tokens, each drawn from its logits by its own settings."""
        return sample(logits, self.sampling_batch(step.seqs, step.sample_positions))

    def copy_to_host(self, step: LaunchedStep, *tensors):
        """Start copying tensors into step.host, which _read_back waits for (step.copied)."""
        if not self.use_cuda:
            step.host += tensors           # on the CPU they are host tensors already
            return
        step.host += [t.to("cpu", non_blocking=True) for t in tensors]   # into pinned memory
        step.copied = torch.cuda.Event()
        step.copied.record()               # on the stream, after the copies

# ---------------------------------------------------------------------------
# Engine core
# The step loop: schedule, launch, read back, and hand each sampled token to its sequence. The
# calls, per step: step -> _launch (Scheduler.schedule, ModelRunner.launch) -> ModelRunner.sample
# -> _commit (_read_back waits for the tokens; _append_token each, and _finish_reason). The
# engine core sees token ids only. Text, and all else per request that it never needs, live in
# the front end (Requests in, text out). For LLM.generate it runs in the caller's thread; behind
# the server, in a thread of its own (Server).

@dataclass
class EngineCoreRequest:
    """A request as it crosses into the engine core: token ids, not text."""
    request_id: str
    prompt_token_ids: list
    params: SamplingParams

@dataclass
class EngineCoreAbort:
    """Stop this request (its client left, or the front end ended it)."""
    request_id: str

@dataclass
class EngineCoreOutput:
    """What one step produced for one request."""
    request_id: str
    token_id: Optional[int]           # the sampled token; None if the request failed
    finish_reason: Optional[str] = None   # "stop", "length" or "error"
    error: str = ""                   # what failed, with finish_reason "error"

class EngineCore:
    # The classes it is built from. Part one's here; the default engine at the end of the file
    # names its own.
    allocator_class, scheduler_class, runner_class = BlockAllocator, Scheduler, ModelRunner
    sequence_class, output_class = Sequence, EngineCoreOutput

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.runner = self.runner_class(cfg)
        self.allocator = self.allocator_class(self.runner.num_blocks)
        self.scheduler = self.scheduler_class(cfg, self.allocator)
        self.seqs: dict[str, Sequence] = {}          # unfinished requests by id
        self.committed: list = []   # the step in progress's outputs, each as made: a step that
                                    # raises still hands these on (EngineCoreClient._step)
        self.num_generated_tokens = 0                      # for stats()

    def add_request(self, request: EngineCoreRequest):
        """Queue a checked request (FrontEnd.validate) in waiting, for the scheduler to admit."""
        seq = self.sequence_class(request.request_id, request.prompt_token_ids, request.params)
        if request.params.seed is not None:
            seq.generator = torch.Generator(self.runner.device)   # seeded for each token (sample)
        self.seqs[seq.request_id] = seq
        self.scheduler.waiting.append(seq)

    def abort_request(self, request_id: str):
        """Stop a request now; its blocks go back to the pool."""
        seq = self.seqs.pop(request_id, None)
        if seq is not None:
            self.scheduler.finish(seq, "abort")

    def has_unfinished(self) -> bool:
        return bool(self.scheduler.waiting or self.scheduler.running)

    def stats(self) -> dict:
        """The engine's gauges, and its counters (the _total ones), for LLM.stats()."""
        a, s = self.allocator, self.scheduler
        return dict(requests_running=len(s.running), requests_waiting=len(s.waiting),
                    kv_blocks_used=a.num_blocks - a.num_free_blocks, kv_blocks_total=a.num_blocks,
                    generated_tokens_total=self.num_generated_tokens,
                    preemptions_total=s.num_preemptions)

    def step(self) -> list:
        """One step, whole: schedule and launch it, sample it on the device, then read its tokens
        back (_commit). Returns an EngineCoreOutput per token read back."""
        self.committed = []     # _commit adds each output as it makes it (EngineCoreClient._step)
        launched = self._launch()
        if launched is not None:
            self.runner.sample(launched)
            self._commit(launched)
        outputs, self.committed = self.committed, []   # handed out: no fault passes them on again
        return outputs

    def _launch(self) -> Optional[LaunchedStep]:
        batch = self.scheduler.schedule()
        if not batch.seqs:
            return None
        step = self.runner.launch(batch)
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            seq.num_computed_tokens += n        # their K/V are on the way into the cache
        return step

    def _commit(self, step: LaunchedStep):
        """Read a step's tokens back and hand each to its sequence; each output it makes goes
        into self.committed at once."""
        for seq, row in self._read_back(step):
            self.committed.append(self._append_token(seq, *row))

    def _read_back(self, step: LaunchedStep):
        """The step's sampled rows on the host, (seq, row) each: a row is its entry of each
        tensor in step.host, its token first (in part one, its token alone). Waiting on the copy
        is the step's one host-device sync."""
        if step.copied is not None:
            step.copied.synchronize()          # this step only, not one launched after it
        host = [t.tolist() for t in step.host]          # [tokens (B,)]
        return zip(step.seqs, zip(*host))

    def _append_token(self, seq: Sequence, token: int) -> EngineCoreOutput:
        """One read-back token into its sequence, and the output reporting it; ends the sequence if
        the token finishes it."""
        seq.token_ids.append(token)
        self.num_generated_tokens += 1
        out = self.output_class(seq.request_id, token)
        out.finish_reason = self._finish_reason(seq, token)
        if out.finish_reason is not None:
            self.scheduler.finish(seq, out.finish_reason)
            del self.seqs[seq.request_id]
        return out

    def _finish_reason(self, seq: Sequence, token: int) -> Optional[str]:
        p = seq.params
        if (token in self.cfg.eos_token_ids and not p.ignore_eos) or token in p.stop_token_ids:
            return "stop"
        if seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.cfg.max_model_len:
            return "length"

# ---------------------------------------------------------------------------
# Requests in, text out
# The front end holds everything per request that the engine core never needs: chat templates,
# tokenizing, checks against the engine's limits, and token ids back to text, a step at a time
# for a stream. It runs in the caller's process, the server's or LLM.generate's.

# -- chat templates --
def _raise_template_error(message: str):
    raise jinja2.TemplateError(message)

class ChatTemplate:
    """The model's chat template (tokenizer_config.json), rendered as transformers does. It is
    code from the checkpoint, so it runs in jinja2's sandbox. Blocks are trimmed, and the template
    may call raise_exception and strftime_now."""
    def __init__(self, tokenizer_config: dict):
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
        env.globals.update(raise_exception=_raise_template_error, strftime_now=time.strftime)
        self.source = tokenizer_config.get("chat_template") or ""
        self.template = env.from_string(self.source) if self.source else None  # None: no chat
        # older configs write a special token as {"content": "<s>", ...}
        tokens = {name: tokenizer_config.get(name) or "" for name in ("bos_token", "eos_token")}
        self.special_tokens = {k: t["content"] if isinstance(t, dict) else t
                               for k, t in tokens.items()}

    def render(self, messages: list, tools: Optional[list] = None) -> str:
        """The prompt text of the messages (and of the tools they may call, for a template that
        renders tools)."""
        if self.template is None:
            raise ValueError("this model has no chat template: use /v1/completions")
        try:
            return self.template.render(messages=messages, tools=tools, add_generation_prompt=True,
                                        **self.special_tokens)
        except jinja2.TemplateError as e:
            raise ValueError(f"the chat template rejected the messages: {e}")

def load_tokenizer(model_dir: str):
    """tokenizer.json and tokenizer_config.json, or (None, {}) for a bare checkpoint."""
    from tokenizers import Tokenizer
    tok, conf = Path(model_dir, "tokenizer.json"), Path(model_dir, "tokenizer_config.json")
    return (Tokenizer.from_file(str(tok)) if tok.is_file() else None,
            json.loads(conf.read_text()) if conf.is_file() else {})

@dataclass
class Delta:
    """What a request got since the last Delta taken: a stream sends each, a body joins them."""
    index: int                        # which of a server request's choices
    text: str                         # new text that is safe to send (may be "")
    token_ids: list                   # the new tokens
    finish_reason: Optional[str]      # "stop", "length" or "error" on the last one

class RequestState:
    """One request as the front end sees it; LLM.generate returns these (vLLM's RequestOutput)."""
    def __init__(self, request_id: str, prompt_ids: list, params: SamplingParams,
                 incremental: bool, index: int = 0, queue: Optional[asyncio.Queue] = None):
        self.request_id, self.prompt_token_ids, self.params = request_id, prompt_ids, params
        self.index = index                # which of a server request's choices
        self.incremental = incremental    # text at each step (the server's), or only at the end
        self.token_ids, self.text = [], ""            # the completion's
        self.num_sent_chars = self.num_sent_tokens = 0   # of those, taken in Deltas
        self.finish_reason, self.error = None, ""
        self.arrival_time = time.perf_counter()   # perf_counter() times, for latencies
        self.first_token_time = self.finish_time = None
        self.queue = queue                # the server's: _deliver puts each change

    def take_delta(self) -> Delta:
        """All that is new since the last call."""
        delta = Delta(self.index, self.text[self.num_sent_chars:],
                      self.token_ids[self.num_sent_tokens:], self.finish_reason)
        self.num_sent_chars, self.num_sent_tokens = len(self.text), len(self.token_ids)
        return delta

def check_sampling_params(p: SamplingParams):
    """SamplingParams' own checks: a ValueError, naming the field first. One also normalizes: a
    tiny temperature becomes 0."""
    if not isinstance(p.max_tokens, int) or p.max_tokens < 1:
        raise ValueError(f"max_tokens must be an integer >= 1, got {p.max_tokens!r}")
    if not 0 <= p.temperature < math.inf:
        raise ValueError(f"temperature must be finite and >= 0, got {p.temperature}")
    if p.temperature < 1e-5:   # greedy, as vLLM takes it: logits / 1e-40 (a denormal) overflow
        p.temperature = 0.0    # fp32 to inf, and the softmax of inf is NaN
    if not 0 < p.top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {p.top_p}")
    if p.top_k == 0 or p.top_k < -1:
        raise ValueError(f"top_k must be -1 (off) or >= 1, got {p.top_k}")
    if p.seed is not None and (type(p.seed) is not int or not -2**63 <= p.seed < 2**64):
        raise ValueError(f"seed must be an integer from -2**63 to 2**64 - 1, got {p.seed!r}")

class FrontEnd:
    """Text in, token ids to the engine core; token ids back, text out."""
    state_class = RequestState        # what it tracks each request with
    def __init__(self, cfg: Config, num_blocks: int):
        self.cfg, self.num_blocks = cfg, num_blocks
        self.tokenizer, tokenizer_config = load_tokenizer(cfg.model)
        self.chat_template = ChatTemplate(tokenizer_config)
        self.states: dict[str, RequestState] = {}    # unfinished requests by id

    # -- requests in --
    def encode(self, prompt, add_special_tokens: bool = True) -> list:
        if not isinstance(prompt, str):
            if not all(type(t) is int for t in prompt):      # not bool, which is an int too
                raise ValueError("a prompt must be a string or a list of token ids")
            return list(prompt)
        if self.tokenizer is None:
            raise ValueError(f"{self.cfg.model} has no tokenizer.json: pass token ids")
        if not prompt.isascii() and any(0xD800 <= ord(c) < 0xE000 for c in prompt):
            raise ValueError("the text has a lone surrogate, which is not Unicode text")
        # encode_batch (Rust) drops the GIL: a long prompt, in a thread, never stalls the event loop
        return self.tokenizer.encode_batch([prompt], add_special_tokens=add_special_tokens)[0].ids

    def validate(self, prompt_ids: list, params: SamplingParams):
        """Every check the engine core relies on, made before it sees the request."""
        check_sampling_params(params)
        # A field beyond part one's (a SamplingParams may carry more) is refused, not ignored.
        default = type(params)() if self.cfg.part_one else None
        for f in dataclasses.fields(params) if self.cfg.part_one else ():
            if f.name not in PART_ONE_SAMPLING_FIELDS and \
                    getattr(params, f.name) != getattr(default, f.name):
                raise ValueError(f"part one's engine (--part-one) has no {f.name}: leave it "
                                 f"out, or leave out --part-one")
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        if min(prompt_ids) < 0 or max(prompt_ids) >= self.cfg.vocab_size:   # C loops, not Python
            raise ValueError(f"prompt token ids must be in [0, {self.cfg.vocab_size})")
        total = len(prompt_ids) + params.max_tokens
        if total > self.cfg.max_model_len:
            raise ValueError(f"the prompt ({len(prompt_ids)} tokens) plus max_tokens "
                             f"({params.max_tokens}) is {total} tokens, more than the "
                             f"context window of {self.cfg.max_model_len}")
        if math.ceil(total / self.cfg.block_size) > self.num_blocks:
            raise ValueError(f"{total} tokens do not fit in the KV cache "
                             f"({self.num_blocks} blocks of {self.cfg.block_size})")

    def add(self, prompt_ids: list, params: SamplingParams, incremental: bool = True,
            index: int = 0, queue=None) -> EngineCoreRequest:
        """Track a checked request; return what to send the engine core."""
        state = self.state_class(uuid.uuid4().hex, prompt_ids, params, incremental, index, queue)
        self.states[state.request_id] = state
        return EngineCoreRequest(state.request_id, prompt_ids, params)

    # -- outputs back --
    def process(self, outputs: list) -> tuple[list, list]:
        """Apply one or more steps' outputs. Return the changed requests, and the ids of those the
        front end ended while the engine core still runs them, for it to abort (part one's front
        end ends none). Tokens the engine core computes past such an end are dropped: those of
        the steps it ran before the abort reached it (none in part one's synchronous step; a few
        behind the server, where tokens and abort each cross a queue)."""
        now, changed = time.perf_counter(), {}   # request id -> its state
        for out in outputs:
            state = self.states.get(out.request_id)
            if state is None:                  # ended here already, or aborted
                continue
            changed[out.request_id] = state
            state.first_token_time = state.first_token_time or now
            state.finish_reason, state.error = out.finish_reason, out.error
            if out.token_id is not None:
                state.token_ids.append(out.token_id)
        states = list(changed.values())
        self._detokenize([s for s in states if s.incremental or s.finish_reason])   # or at the end
        for state in states:
            if state.finish_reason is not None:
                del self.states[state.request_id]
                state.finish_time = now
        return states, []

    def decode(self, token_ids: list) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def _detokenize(self, states: list):
        """Each request's text: all its tokens decoded again, whole, every request in one batched
        decode. A token alone may decode differently than after the others: a leading space, or
        a character whose bytes two tokens split. Text that ends in U+FFFD (half a character)
        waits up to it for the token that ends it; at the end all of it is the text."""
        if self.tokenizer is None or not states:
            return
        texts = self.tokenizer.decode_batch([s.token_ids for s in states],
                                            skip_special_tokens=True)
        for s, text in zip(states, texts):
            s.text = text if s.finish_reason else text.rstrip("\ufffd")   # whole characters

class LLM:
    """Offline generation in vLLM's shape: LLM(model_dir).generate(prompts, SamplingParams(...))
    -> [RequestState]. The engine core runs in this process: offline, nothing competes with it.
    It runs engine_class and front_class, which the end of the file sets to the default engine's;
    with part_one, part one's EngineCore and FrontEnd."""
    engine_class, front_class = EngineCore, FrontEnd

    def __init__(self, model=DEFAULT_MODEL, **settings):   # a folder, or a whole Config
        cfg = model if isinstance(model, Config) else Config(model=model, **settings)
        self.engine = (EngineCore if cfg.part_one else self.engine_class)(cfg)
        front_class = FrontEnd if cfg.part_one else self.front_class
        self.front = front_class(cfg, self.engine.allocator.num_blocks)

    def add(self, prompt_ids: list, params: SamplingParams, incremental=False) -> RequestState:
        self.front.validate(prompt_ids, params)
        request = self.front.add(prompt_ids, params, incremental)
        self.engine.add_request(request)
        return self.front.states[request.request_id]

    def run(self):
        """Step until every request is done, yielding after each step."""
        while self.engine.has_unfinished():
            _, stopped = self.front.process(self.engine.step())
            for request_id in stopped:
                self.engine.abort_request(request_id)
            yield

    def generate(self, prompts, params=None) -> list:
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} SamplingParams")
        prompt_ids = [self.front.encode(prompt) for prompt in prompts]
        for ids, p in zip(prompt_ids, params):   # check all before queueing any
            self.front.validate(ids, p)
        states = [self.add(ids, p) for ids, p in zip(prompt_ids, params)]
        start, num_before = time.perf_counter(), self.engine.num_generated_tokens
        for _ in self.run():   # this call's rate: an LLM may have generated before
            rate = (self.engine.num_generated_tokens - num_before) / (time.perf_counter() - start)
            if len(states) > 1:            # on a terminal only: one line, rewritten
                _progress(f"generate: {sum(s.finish_reason is not None for s in states)}/"
                          f"{len(states)} done, {rate:.0f} tok/s")
        return states

    def stats(self) -> dict:
        return self.engine.stats()

    def close(self):
        """Release what the engine holds beyond its memory (ModelRunner.close)."""
        self.engine.runner.close()

# ---------------------------------------------------------------------------
# Server
# An OpenAI-compatible HTTP API on Starlette. OpenAI's terms: a choice is one of the n answers a
# request asks for, a chunk is one piece of a streamed answer, and usage counts a request's
# prompt and completion tokens. The code comes top-down: the server's handlers, the response
# shapes they build, then the engine core's client they run choices on. One streamed chat
# request, each step with who runs it:
#   1. OpenAIServer.chat, the handler (event loop): read_fields checks the body, answer_chat
#      renders the chat template (chat_text), _encode tokenizes in a worker thread, and
#      sampling_params makes n SamplingParams. _respond checks each choice
#      (FrontEnd.validate) and returns a StreamingResponse over shape.stream.
#   2. The StreamingResponse (event loop) pulls events. A chat stream's role chunk comes first
#      (_ChatShape.opening); the next pull starts EngineCoreClient.generate, which tracks each
#      choice in the front end (FrontEnd.add) and puts them in `outgoing`.
#   3. _run (the engine core's thread) takes them, steps, and hands each step's outputs to the
#      event loop (call_soon_threadsafe).
#   4. _deliver (event loop): FrontEnd.process, then each changed RequestState onto its queue.
#   5. generate yields the state. shape.chunks turns its new part (a Delta) into chunks, and
#      shape.stream writes each as an SSE event. Steps 3-5 repeat until every choice ends.
# A stream's events, by example, are above _ChatShape.
#
# One /v1/completions request with n = 2 and no "stream": sampling_params makes two
# SamplingParams (with a "seed", seeds seed and seed + 1; without, both draw at random), and
# _respond pairs the prompt with each: choices 0 and 1. generate sends both in one list, and
# their two RequestStates share one queue, so the states come interleaved, each with its
# choice's index. shape.body pulls them through _until_gone and shape.chunks, and folds each
# chunk into the whole of its choice (_fold): text joins, the finish_reason comes once. The body
# goes out when both choices have finished.
#
# Async generators pull each other: streamed, shape.stream pulls shape.chunks, which pulls
# client.generate; not streamed, the coroutine shape.body pulls shape.chunks, which pulls
# _until_gone, which pulls generate. Each holds the one it pulls in an `aclosing`, so when one
# closes, or an error rises through it, it closes the next, down to generate, whose `finally`
# aborts what still runs.
#
# A client that leaves:
#   streamed      Starlette's StreamingResponse, which under uvicorn listens for the client's
#                 disconnect message beside its writing, cancels the writing. The CancelledError rises
#                 where it waits (most often at generate's queue), through shape.stream and
#                 shape.chunks, and closes each generator on the way.
#   not streamed  No one cancels a handler: _until_gone asks after each state, and raises a 499
#                 that closes the generators the same way.
#   then          generate's `finally` drops the unfinished choices from the front end and
#                 queues their aborts (_abort). _run applies them before its next step
#                 (EngineCore.abort_request), and Scheduler.finish frees their blocks.

class APIError(Exception):
    """An error in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""
    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: Optional[str] = None, code: Optional[str] = None):
        super().__init__(message)
        self.status = status
        self.body = {"error": {"message": message, "type": type, "param": param, "code": code}}

# -- the server: its routes, and a request's way through them --
class OpenAIServer:
    """The routes over one EngineCoreClient; its handlers run on the server's event loop."""
    # The fields each endpoint reads, with the JSON type each must have (a number: int or float).
    fields = {"completions": dict(model=str, prompt=(str, list), max_tokens=int,
                                  temperature=(int, float), top_p=(int, float), top_k=int,
                                  seed=int, n=int, ignore_eos=bool, stream=bool,
                                  stream_options=dict)}
    fields["chat"] = {**fields["completions"], "messages": list, "max_completion_tokens": int}
    del fields["chat"]["prompt"]

    def __init__(self, client: EngineCoreClient, cfg: Config):
        self.client, self.front, self.cfg = client, client.front, cfg
        self.model_name = Path(cfg.model).name             # what clients pass as 'model'

    def app(self) -> Starlette:
        """The app. Its lifespan starts the client stepping; an APIError is answered in OpenAI's
        shape."""
        @contextlib.asynccontextmanager
        async def lifespan(app):
            self.client.start(asyncio.get_running_loop())   # outputs come to this event loop
            yield

        async def error(request: Request, e: APIError) -> Response:
            return JSONResponse(e.body, status_code=e.status)
        return Starlette(routes=self.routes(), lifespan=lifespan,
                         exception_handlers={APIError: error})

    def routes(self) -> list:
        return [Route("/health", self.health),
                Route("/v1/completions", self.completions, methods=["POST"]),
                Route("/v1/chat/completions", self.chat, methods=["POST"])]

    async def health(self, request: Request) -> Response:
        return PlainTextResponse(self.client.error or "ok", 503 if self.client.error else 200)

    # -- a request's way: its handler, then _respond --
    async def read_fields(self, request: Request, endpoint: str) -> dict:
        """The JSON body's fields, each of the type `fields` gives (a JSON null is absent). A field
        not in the table is refused, never ignored: it might have changed the output."""
        try:
            body = json.loads(await request.body())
        except (ValueError, RecursionError) as e:          # bad JSON, bad UTF-8, too deep
            raise APIError(400, f"the body is not valid JSON: {str(e)[:200]}")
        if not isinstance(body, dict):
            raise APIError(400, "the body must be a JSON object")
        spec = self.fields[endpoint]
        for name, value in body.items():
            if name not in spec:
                raise APIError(400, f"part one's engine (--part-one) has no {name}: it reads "
                                    f"{', '.join(spec)}", param=name)
            # true is an int in Python, but not in JSON
            if value is not None and (not isinstance(value, spec[name])
                                      or isinstance(value, bool) != (spec[name] is bool)):
                raise APIError(400, f"'{name}' is not of the JSON type it must have: got "
                                    f"{json.dumps(value)[:40]}", param=name)
        return {name: value for name, value in body.items() if value is not None}

    async def completions(self, request: Request) -> Response:
        f = await self.read_fields(request, "completions")
        prompt = f.get("prompt")
        if not prompt:
            raise APIError(400, "'prompt' is required", param="prompt")
        # one prompt (text or token ids), or a list of them
        prompts = [prompt] if isinstance(prompt, str) or type(prompt[0]) is int else prompt
        prompt_ids = [await self._encode(p) for p in prompts]
        params = await self.sampling_params(f, f.get("max_tokens", 16))
        shape = self.completion_shape(f, prompts, prompt_ids, len(params))
        return await self._respond(request, f, shape, prompt_ids, params)

    async def chat(self, request: Request) -> Response:
        f = await self.read_fields(request, "chat")
        if not (f.get("messages") and all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                          and isinstance(m.get("content"), str)
                                          for m in f["messages"])):
            raise APIError(400, "'messages' must be a non-empty list of objects with a string "
                                "'role' and 'content'", param="messages")
        return await self.answer_chat(request, f)

    async def answer_chat(self, request: Request, f: dict) -> Response:
        """A chat request's checked fields f, answered (an endpoint that stands for a chat
        request answers through here too)."""
        try:
            text = self.chat_text(f)
        except ValueError as e:
            raise APIError(400, str(e), param="messages")
        # the template has written the special tokens: encode must not add its own
        prompt_ids = await self._encode(text, add_special_tokens=False)
        room = max(1, self.cfg.max_model_len - len(prompt_ids))  # default: the whole rest
        params = await self.sampling_params(
            f, f.get("max_completion_tokens", f.get("max_tokens", room)))
        shape = self.chat_shape(f, len(prompt_ids))
        return await self._respond(request, f, shape, [prompt_ids], params)

    def chat_text(self, f: dict) -> str:
        """The prompt a chat request's messages make: the model's chat template, rendered."""
        return self.front.chat_template.render(f["messages"])

    async def _encode(self, prompt, add_special_tokens: bool = True) -> list:
        """Token ids of a prompt; text is tokenized in a thread, off the event loop."""
        try:
            if isinstance(prompt, str):
                return await asyncio.to_thread(self.front.encode, prompt, add_special_tokens)
            return self.front.encode(prompt)
        except ValueError as e:
            raise APIError(400, str(e), param="prompt")

    async def sampling_params(self, f: dict, max_tokens: int) -> list:
        """n SamplingParams, the n choices of each prompt (_respond pairs every prompt with each).
        Choice i seeds seed + i: n different, reproducible choices."""
        n, seed = f.get("n", 1), f.get("seed")
        if not 1 <= n <= 128:
            raise APIError(400, "'n' must be in [1, 128] (OpenAI's)", param="n")
        shared = {k: f[k] for k in ("temperature", "top_p", "top_k", "ignore_eos") if k in f}
        return [SamplingParams(**shared, max_tokens=max_tokens,
                               seed=None if seed is None else (seed + i) % 2**64)
                for i in range(n)]

    def stream_response(self, events) -> Response:
        """A stream's response: Starlette's, which sends each SSE event (text) as it comes."""
        return StreamingResponse(events, headers=_SSE_HEADERS)

    def completion_shape(self, f: dict, prompts: list, prompt_ids: list, n: int) -> _Shape:
        return _CompletionShape(self, f, sum(map(len, prompt_ids)))

    def chat_shape(self, f: dict, num_prompt_tokens: int) -> _Shape:
        return _ChatShape(self, f, num_prompt_tokens)

    async def _respond(self, request: Request, f: dict, shape: _Shape, prompt_ids: list,
                       params: list) -> Response:
        choices = [(ids, p) for ids in prompt_ids for p in params]   # index = prompt * n + choice
        try:   # every choice, each its own checks: they also normalize (a tiny temperature to 0)
            for ids, p in choices:
                self.front.validate(ids, p)
        except ValueError as e:
            name = str(e).split()[0]  # validate's messages start with their field, if any
            raise APIError(400, str(e), param=name if name in f else None)
        if self.client.error:
            raise APIError(503, self.client.error, "internal_error")
        # Lazy: the engine core sees nothing until the stream or the body reads the first state
        states = self.client.generate(choices)
        if f.get("stream"):
            include_usage = f.get("stream_options", {}).get("include_usage") is True
            chunks = shape.chunks(states, len(choices))
            return self.stream_response(shape.stream(chunks, include_usage))
        return JSONResponse(await shape.body(shape.chunks(_until_gone(states, request),
                                                          len(choices))))

async def _until_gone(states, request: Request):
    """A body's states, until its client hangs up. Uvicorn does not cancel a handler whose client
    left (as a StreamingResponse cancels its stream), so after each state it asks: after the
    yield, once the caller has taken the state's Delta (generate says why). Closing this closes
    `states`, whose `finally` aborts what still runs (EngineCoreClient.generate)."""
    async with contextlib.aclosing(states):
        async for state in states:
            yield state
            if await request.is_disconnected():
                raise APIError(499, "the client closed the connection")

# -- response shapes: a stream sends a chunk per Delta; a whole response folds them into one --
_to_json = json.JSONEncoder(ensure_ascii=False).encode   # json.dumps(x, keyword) builds one a call

# Server-sent events: a stream of `data: ...` lines, each event ended by a blank line. Starlette's
# StreamingResponse sends each as it comes, and when the client leaves it cancels the stream:
# the cancellation runs the `finally` of every generator on the way (client.generate's aborts).
_SSE_HEADERS = {"content-type": "text/event-stream; charset=utf-8", "cache-control": "no-cache",
                "x-accel-buffering": "no"}             # nginx: unbuffered

def _sse(data: str) -> str:
    return f"data: {data}\n\n"


class _Shape:
    """A response of any endpoint: its id, envelopes and chunks. f: the request's fields. In the
    order a response calls them: chunks (opening each choice, then per Delta delta_chunks, which
    makes choice's chunk and at the end last's), then stream (SSE events) or body (fold). Each
    piece is a method of its own, so a shape (an endpoint) changes only the one it needs."""
    id_prefix, object, chunk_object = "", "", ""

    def __init__(self, server, f: dict, num_prompt_tokens: int):
        self.server, self.f = server, f
        self.id, self.created = self.id_prefix + uuid.uuid4().hex, int(time.time())
        self.num_prompt_tokens, self.num_completion_tokens = num_prompt_tokens, 0

    def opening(self, i: int) -> list:
        """The chunks a stream opens choice i with."""
        return []

    def envelope(self, object: str, choices: list, usage: bool = False) -> dict:
        body = {"id": self.id, "object": object, "created": self.created,
                "model": self.server.model_name, "choices": choices}
        n, m = self.num_prompt_tokens, self.num_completion_tokens
        return {**body, "usage": {"prompt_tokens": n, "completion_tokens": m,
                                  "total_tokens": n + m}} if usage else body

    async def chunks(self, states, n: int):
        """The choices to send: the openings, then those of each Delta (delta_chunks)."""
        async with contextlib.aclosing(states):
            for choice in [c for i in range(n) for c in self.opening(i)]:
                yield choice
            async for state in states:
                d = state.take_delta()
                if d.finish_reason == "error":
                    raise APIError(500, state.error, "internal_error")
                self.num_completion_tokens += len(d.token_ids)
                for choice in self.delta_chunks(state, d):
                    yield choice

    def delta_chunks(self, state: RequestState, d: Delta) -> list:
        """One Delta's chunks: its new text, if any (the finish_reason is the last chunk's to
        say), then at the end the last chunk."""
        news = [self.choice(d) | {"finish_reason": None}] if d.text else []
        return news + ([self.last(state, d)] if d.finish_reason is not None else [])

    def last(self, state: RequestState, d: Delta) -> dict:
        """The chunk that carries the finish_reason."""
        return self.choice(dataclasses.replace(d, text="", token_ids=[]))

    async def stream(self, chunks, include_usage: bool):
        """OpenAI's stream, as server-sent events (_sse): each chunk's JSON, then `[DONE]`. An
        error after the first byte is an event too: the status line is gone."""
        head = _to_json(self.envelope(self.chunk_object, []))[:-2]   # up to `"choices": [`
        async with contextlib.aclosing(chunks):
            try:
                async for choice in chunks:
                    yield _sse(f"{head}{_to_json(choice)}]}}")
                if include_usage:
                    yield _sse(_to_json(self.envelope(self.chunk_object, [], usage=True)))
            except Exception as e:            # an APIError as it is; a bug logged, in one line
                if not isinstance(e, APIError):
                    traceback.print_exc()
                    e = APIError(500, f"internal error: {e!r}", "internal_error")
                yield _sse(_to_json(e.body))
        yield _sse("[DONE]")

    async def body(self, chunks) -> dict:
        """A non-streamed response: each choice's chunks joined (_fold), a stream's "delta" then
        the whole "message"."""
        choices = {}                                       # index -> the whole choice so far
        async with contextlib.aclosing(chunks):
            async for choice in chunks:
                self.fold(choices.setdefault(choice["index"], {}), choice)
        for c in choices.values():
            if "delta" in c:
                c["message"] = c.pop("delta")
        return self.envelope(self.object, [choices[i] for i in sorted(choices)], usage=True)

    def fold(self, whole: dict, chunk: dict):
        """Join a chunk into the whole of its choice (_fold)."""
        _fold(whole, chunk)

class _CompletionShape(_Shape):
    """The legacy completions shape: a choice's text."""
    id_prefix, object, chunk_object = "cmpl-", "text_completion", "text_completion"

    def choice(self, d: Delta) -> dict:
        return {"index": d.index, "text": d.text, "logprobs": None,
                "finish_reason": d.finish_reason}

# What a client sees of a chat request with "stream": true, an SSE event a line (id, created,
# model and "logprobs": null left out):
#     data: {"object": "chat.completion.chunk", "choices": [{"index": 0,
#            "delta": {"role": "assistant", "content": ""}, "finish_reason": null}]}
#     data: {"object": "chat.completion.chunk", "choices": [{"index": 0,
#            "delta": {"content": "Paris"}, "finish_reason": null}]}
#     data: {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {},
#            "finish_reason": "stop"}]}
#     data: [DONE]
# Without "stream", the same chunks fold into one body: {"object": "chat.completion", "choices":
# [{"index": 0, "message": {"role": "assistant", "content": "Paris"}, "finish_reason": "stop"}],
# "usage": {...}}. A completions request's choices carry "text" instead of "delta" or "message".

class _ChatShape(_Shape):
    """The chat shape: a stream sends a choice's role, then its deltas, then its finish_reason."""
    id_prefix, object, chunk_object = "chatcmpl-", "chat.completion", "chat.completion.chunk"

    def opening(self, i: int) -> list:
        return [{"index": i, "delta": {"role": "assistant", "content": ""},
                 "logprobs": None, "finish_reason": None}]

    def choice(self, d: Delta) -> dict:
        return {"index": d.index, "delta": {"content": d.text} if d.token_ids else {},
                "logprobs": None, "finish_reason": d.finish_reason}

def _fold(whole: dict, chunk: dict):
    """Fold a chunk into the whole, key by key. Strings and lists concatenate, and objects fold
    alike. Other values replace the old, but null never."""
    for key, value in chunk.items():
        old = whole.get(key)
        if isinstance(value, dict) and isinstance(old, dict):
            _fold(old, value)
        elif isinstance(value, (str, list)) and old is not None:
            whole[key] = old + value
        elif value is not None or key not in whole:
            whole[key] = value

# -- the engine core's client: choices out, their states back, on the event loop --
class EngineCoreClient:
    """The server's handle on the engine core, which steps in a thread of its own (_run). generate
    sends a request's choices into `outgoing` and yields their states as they change. _deliver,
    on the event loop, hands each step's outputs to their requests' queues. It knows no HTTP: a
    failed request ends with finish_reason "error"."""
    # the default engine's front end and server (an OpenAIServer), set at the end of the file
    front_class, server_class = FrontEnd, None

    def __init__(self, cfg: Config):
        self.outgoing = queue.SimpleQueue()  # to the engine core: lists of requests or aborts
        self.error = ""                      # why the engine core is gone (an error ends it)
        num_blocks = self.start_engine_core(cfg)
        front_class = FrontEnd if cfg.part_one else self.front_class
        self.front = front_class(cfg, num_blocks)      # the pool bounds a request

    def start_engine_core(self, cfg: Config) -> int:
        """Build the engine core, here; return its pool's size in blocks."""
        self.engine = EngineCore(cfg)
        return self.engine.allocator.num_blocks

    stats = property(lambda self: self.engine.stats())

    def start(self, loop: asyncio.AbstractEventLoop):
        """With the event loop (the app's lifespan): start stepping."""
        self.thread = threading.Thread(target=self._run, args=(loop,), name="engine-core")
        self.thread.start()

    def shutdown(self):
        self.outgoing.put(None)                  # _run ends there: what is queued is dropped
        if getattr(self, "thread", None):
            self.thread.join()

    def _run(self, loop: asyncio.AbstractEventLoop):
        """The engine core's thread: take what the server sent (block only when idle), step,
        and hand the step's outputs to the event loop, until `None` comes (shutdown). A step's
        fault ends every request the engine holds (_step). Any other fault ends the thread, and
        with it the engine: `error` says why, and every request in flight ends with it
        (fail_all)."""
        try:
            while True:
                items = [] if self.engine.has_unfinished() else [self.outgoing.get()]
                while not self.outgoing.empty():
                    items.append(self.outgoing.get())
                if None in items:
                    return
                for item in (item for message in items for item in message):  # in the order sent
                    if isinstance(item, EngineCoreAbort):
                        self.engine.abort_request(item.request_id)
                    else:
                        self.engine.add_request(item)
                if self.engine.has_unfinished():
                    loop.call_soon_threadsafe(self._deliver, self._step())
        except Exception as e:
            traceback.print_exc()
            self.error = f"the engine core stopped: {e!r}"
            loop.call_soon_threadsafe(self.fail_all)

    def _step(self) -> list:
        """One step's outputs. A step that raises ends every request in error, not the server.
        The outputs it made before the fault come first: a request they finished has left
        engine.seqs, and would get no answer else."""
        try:
            return self.engine.step()
        except Exception as e:
            traceback.print_exc()
            made, self.engine.committed = self.engine.committed, []
            failed = list(self.engine.seqs)
            for request_id in failed:
                self.engine.abort_request(request_id)
            return made + [EngineCoreOutput(request_id, None, finish_reason="error",
                                            error=f"the engine failed: {e!r}")
                           for request_id in failed]

    # (A client that leaves: the table at the top of this section.)
    async def generate(self, requests: list):
        """Run one HTTP request's choices, (prompt_ids, SamplingParams) each; yield a choice's
        RequestState at each change until all finish. However the caller stops (done, client
        gone, error), `finally` aborts what still runs: its KV blocks free before the next step.
        An async generator, it runs nothing until its caller pulls the first state.
        Each change puts the state object itself on `changed` again (_deliver); once one comes
        finished, its later comings are dropped. So the caller takes a state's Delta before it
        awaits anything. Otherwise: S comes running -> the caller awaits -> S finishes and is
        queued again -> the caller's Delta holds the finish -> S comes again, finished, and its
        finish_reason is sent twice."""
        changed = asyncio.Queue()                         # RequestStates of this request's choices
        requests = [self.front.add(ids, p, index=i, queue=changed)
                    for i, (ids, p) in enumerate(requests)]
        unfinished = {r.request_id for r in requests}
        try:
            if self.error:                          # gone since the handler checked
                self.fail_all()
            self.outgoing.put(requests)
            while unfinished:
                state = await changed.get()
                if state.request_id in unfinished:  # else a late repeat of a finished one
                    if state.finish_reason is not None:
                        unfinished.discard(state.request_id)
                    yield state
        finally:
            for request_id in unfinished:
                self.front.states.pop(request_id, None)
            self._abort(list(unfinished))

    def fail_all(self):
        """On the event loop, once the engine core is gone: every request in flight ends in
        error, with `error`."""
        for state in self.front.states.values():
            state.finish_reason, state.error = "error", self.error
            state.queue.put_nowait(state)
        self.front.states.clear()

    def _abort(self, request_ids: list):
        if request_ids and not self.error:
            self.outgoing.put([EngineCoreAbort(request_id) for request_id in request_ids])

    def _deliver(self, outputs: list) -> list:
        """On the event loop: steps' outputs through the FrontEnd, out to the requests' queues.
        Returns the requests' states it handed on."""
        states, stopped = self.front.process(outputs)
        self._abort(stopped)
        for state in states:
            state.queue.put_nowait(state)
        return states

# -- the app --
def build_app(client: EngineCoreClient, cfg: Config) -> Starlette:
    """The app over a running engine core: the default server's (client.server_class), or with
    part_one part one's OpenAIServer."""
    return (OpenAIServer if cfg.part_one else client.server_class)(client, cfg).app()

def serve(cfg: Config, client_class=EngineCoreClient):
    """Serve the API until stopped. client_class: part one's EngineCoreClient, or the default
    engine's (main, at the end of the file, says which)."""
    sock = socket.create_server((cfg.host, cfg.port))   # first: a port in use fails at once
    client = client_class(cfg)
    # SIGTERM drains (README), then uvicorn re-raises it: its default action ends this process at
    # once, engine core and all, and `finally` never runs. Ctrl-C comes back as KeyboardInterrupt,
    # and shutdown stops the engine core.
    try:
        print(f"serving {Path(cfg.model).name} at http://{cfg.host}:{cfg.port}/v1"
              + (" (API key required)" if cfg.api_key else ""), flush=True)
        server = uvicorn.Server(uvicorn.Config(build_app(client, cfg), log_level="warning"))
        server.run(sockets=[sock])
    finally:
        client.shutdown()

# ---------------------------------------------------------------------------
# CLI
# `generate` streams one completion to stdout (all else goes to stderr), and `serve` starts the
# HTTP server. The flags are made from the Config and SamplingParams fields: no parser code.

def add_dataclass_flags(parser: argparse.ArgumentParser, cls, skip=()):
    for f in dataclasses.fields(cls):
        if not f.init or "help" not in f.metadata or f.name in skip:
            continue
        name = f.metadata["flag"] or "--" + f.name.replace("_", "-")
        if f.type == "bool":    # (types are strings: `from __future__ import annotations`)
            # a flag that is on by default turns it off
            kw = dict(action="store_false" if f.default else "store_true",
                      help=("do not " if f.default else "") + f.metadata["help"])
        elif f.type == "Optional[list]":   # repeatable: --name A --name B
            kw = dict(action="append", help=f.metadata["help"])
        else:                            # int, float or str, Optional or not
            kind = float if "float" in f.type else int if "int" in f.type else str
            kw = dict(type=kind, default=f.default, help=f.metadata["help"])
        parser.add_argument(name, dest=f.name, **kw)

def from_flags(cls, args: argparse.Namespace):
    return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)
                  if f.init and hasattr(args, f.name)})

def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nanoserve.py", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    gen = commands.add_parser("generate", help="stream one completion to the terminal")
    gen.add_argument("prompt", help="the prompt text")
    add_dataclass_flags(gen, Config, skip=("host", "port", "api_key", "max_request_bytes"))
    add_dataclass_flags(gen, SamplingParams)
    gen.set_defaults(max_tokens=128)                      # a terminal wants more than the API's 16
    add_dataclass_flags(commands.add_parser("serve", help="OpenAI-compatible HTTP server"), Config)
    return parser

def run_generate(cfg: Config, prompt: str, params: SamplingParams):
    llm = LLM(cfg)                     # part one's engine with --part-one, else the default one
    state = llm.add(llm.front.encode(prompt), params, incremental=True)
    for _ in llm.run():
        print(state.take_delta().text, end="", flush=True)
    print()
    _progress(speed_line(llm, state), end=True)

def speed_line(llm: LLM, state: RequestState) -> str:
    """What `generate` prints on stderr after its answer: the tokens, the seconds from the
    request's arrival to its end, when the first token came, and the decode speed. The first
    token waits for the prompt's prefill, and in a fresh process for the warm-up too (the first
    launch of each kernel). So the decode speed leaves it out: the tokens after the first, over
    the time after it."""
    n, start, first = len(state.token_ids), state.arrival_time, state.first_token_time
    line = f"{n} tokens in {state.finish_time - start:.2f} s"
    if n:
        line += f" (first token after {first - start:.2f} s)"
    if n > 1:
        line += f", decode {(n - 1) / (state.finish_time - first):.1f} tok/s"
    return line

def ensure_default_model(model: str):
    """The default model is made on first use (download.py converts it)."""
    if model == DEFAULT_MODEL and not Path(model, "config.json").is_file():
        import download
        download.download()

# ---------------------------------------------------------------------------
# Chapter: async scheduling (the one-ahead overlap)
# Part one's EngineCore.step runs schedule, launch, sample and read-back in turn. So the device
# waits while the host schedules and prepares, and the host waits while the device computes.
# With async_scheduling (the default), step launches step N+1 before it reads step N's tokens
# back, and the host's work hides behind the device's.
# Then a sequence's input in step N+1 is the token it sampled in step N, which is still only in
# device memory: its pending token. A sequence counts them (AsyncSequence.num_pending_tokens)
# from the launch that samples one to the read-back that appends it. The scheduler computes a
# pending token like any other, since its count adds them (AsyncScheduler). The runner's
# _flatten leaves a placeholder in its input row, and put_pending_tokens fills it from step N's
# samples on the device (AsyncRunner). Once the prompt is computed,
# num_computed_tokens == len(token_ids) + num_pending_tokens - 1 between steps: every token but
# the newest is launched.
# One decoding sequence through one call of AsyncEngineCore.step, L = len(token_ids) before it:
#
#     moment in step                                 len(token_ids)  pending  computed
#     before: step N launched and sampled                  L            1         L
#     schedule: n = L + 1 - L = 1 token to compute         L            1         L
#     _launch: step N+1 launched, counted                  L            2       L + 1
#     _commit: step N's token read back, appended        L + 1          1       L + 1
#     sample: step N+1's token sampled on the device     L + 1          1       L + 1
#
# So the count is 1 between calls, and 2 between a launch and the commit of the step before. It
# is 0 between calls until the prompt's last chunk is launched, after a failed step
# (fail_running), and after a step the sequence sat out (a decode the burst rule held back, one
# preempted). A sequence whose pending token is its last, by length, is not scheduled again
# (ends_when_read): reading that token back ends it.
# Sampling still comes after the read-back. So whatever reads the tokens so far to sample (a
# penalty, a grammar) sees all of them, and the host's work hides behind step N+1's forward pass.
# Extends: Sequence (num_pending_tokens), Scheduler (_schedule_running: the count, and
# ends_when_read), ModelRunner (_flatten's placeholder, the input ids), EngineCore (step, _launch,
# _commit). Each per-row loop it changes, it replaces whole: no call per row is added.

class AsyncSequence(Sequence):
    num_pending_tokens = 0   # rows launched to sample a token, not yet read back (the table above)

class AsyncScheduler(Scheduler):
    def _schedule_running(self, batch: ScheduledBatch, budget: int, seqs: list) -> int:
        """Part one's loop, with each sequence's pending tokens to compute too, and none run
        whose pending token is its last by length (ends_when_read): reading it back ends it."""
        for seq in seqs:
            if budget == 0:
                break
            if seq.status != "running" or ends_when_read(seq, self.cfg.max_model_len):
                continue
            n = min(seq.num_tokens + seq.num_pending_tokens - seq.num_computed_tokens, budget)
            if self._reserve_blocks(seq, n):
                batch.seqs.append(seq), batch.num_new_tokens.append(n)
                budget -= n
        return budget

def ends_when_read(seq: Sequence, max_model_len: int) -> bool:
    """True if seq's pending token is its last by length: no later step is worth launching."""
    num_tokens = seq.num_tokens + seq.num_pending_tokens
    return seq.num_pending_tokens > 0 and (
        num_tokens - seq.num_prompt_tokens >= seq.params.max_tokens
        or num_tokens >= max_model_len)

class AsyncRunner(ModelRunner):
    """launch(batch, prev): prev is the step still on the device, whose samples are some of this
    step's inputs (None: none are)."""
    prev, pending = None, []     # the step before, and this step's (row, seq) of pending inputs

    def launch(self, batch: ScheduledBatch, prev: Optional[LaunchedStep] = None) -> LaunchedStep:
        self.prev = prev
        try:
            return super().launch(batch)
        finally:
            self.prev = None     # no reference kept: its tensors free with it

    def _flatten(self, batch: ScheduledBatch):
        """Part one's _flatten, and the rows whose input is a pending token (self.pending): a
        placeholder there, and the row samples."""
        bs, flat = self.cfg.block_size, dict(input_ids=[], positions=[], slot_mapping=[],
                                             context_lens=[], cu_seqlens_q=[0])
        input_ids, positions, slot_mapping, context_lens, cu_seqlens_q = flat.values()
        samples, pending, tables = [], [], []   # samples and pending: (row, seq)
        width = max(len(seq.block_table) for seq in batch.seqs)
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
            last_row = cu_seqlens_q[-1] + n - 1
            input_ids += seq.token_ids[start:end]
            if end > len(seq.token_ids):       # a pending token
                input_ids.append(0)                # a placeholder, filled on the device
                pending.append((last_row, seq))
            table = seq.block_table
            tables.append(table + [0] * (width - len(table)))   # the row's blocks, then 0s
            positions += range(start, end)
            slot_mapping += [table[p // bs] * bs + p % bs for p in range(start, end)]
            context_lens.append(end)
            cu_seqlens_q.append(last_row + 1)
            if end >= len(seq.token_ids):   # its last input is its newest token: it samples
                samples.append((last_row, seq))
        flat["block_tables"] = np.array(tables, dtype=np.int32)   # (B, width)
        self.pending = pending
        return flat, samples

    def _put_input_ids(self, batch: ScheduledBatch, input_ids: list):
        if not self.pending:
            return super()._put_input_ids(batch, input_ids)
        put_pending_tokens(self, batch, input_ids, self.pending, self.prev)

def put_pending_tokens(runner: ModelRunner, batch: ScheduledBatch, input_ids: list,
                       pending: list, prev: LaunchedStep):
    """The input ids, with each pending (row, seq) copied from prev's samples on the device: no
    host round trip. A steady decode (the same rows as prev) takes all of prev's tokens at once."""
    ids = runner.buffers["input_ids"]
    if batch.is_decode and batch.seqs == prev.seqs:
        ids[:len(batch.seqs)].copy_(prev.tokens)
        return
    pa.put(ids, input_ids)
    prev_rows = {seq: i for i, seq in enumerate(prev.seqs)}
    rows, src = zip(*[(row, prev_rows[seq]) for row, seq in pending])
    ids.index_copy_(0, pa.to_device(runner.device, rows, torch.int64),
                    prev.tokens[pa.to_device(runner.device, src, torch.int64)])

class AsyncEngineCore(EngineCore):
    def __init__(self, cfg: Config):
        super().__init__(cfg)
        self.launched: Optional[LaunchedStep] = None   # the step on the device between calls

    def step(self) -> list:
        """EngineCore.step with the overlap: launch the next step, read back the previous call's
        (into self.committed; nothing on the first call), then sample the new one. With
        --no-async-scheduling, part one's step."""
        if not self.cfg.async_scheduling:
            return super().step()
        self.committed = []
        prev = self._step_before()
        try:
            self.launched = self._launch(prev)     # step N+1, before step N is read back
        finally:                    # even if the launch raises: fail_running passes step N's
            if prev is not None:    # outputs on, as it does when sample raises below
                self._commit(prev)
        if self.launched is not None:
            self.runner.sample(self.launched)
        outputs, self.committed = self.committed, []
        return outputs

    def _step_before(self) -> Optional[LaunchedStep]:
        """The step still on the device, whose samples the next step takes as inputs."""
        return self.launched

    def _launch(self, prev: Optional[LaunchedStep] = None) -> Optional[LaunchedStep]:
        batch = self.scheduler.schedule()
        if not batch.seqs:
            return None
        step = self.runner.launch(batch, prev)
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            seq.num_computed_tokens += n        # their K/V are on the way into the cache
        for seq in step.seqs:                   # one per row it samples
            seq.num_pending_tokens += 1         # until _commit reads it back
        return step

    def _commit(self, step: LaunchedStep):
        for seq, row in self._read_back(step):
            seq.num_pending_tokens -= 1         # read back: no longer pending
            if not seq.is_finished:             # else aborted, or ended by the step before
                self.committed.append(self._append_token(seq, *row))

# ---------------------------------------------------------------------------
# Chapter: CUDA graphs
# A graph holds every kernel launch of one forward pass, recorded once (capture) and replayed in
# one launch, where 200 launches from Python would leave the GPU idle. Graphs are captured on
# CUDA with the Triton attention, unless --enforce-eager. Then every step replays one; elsewhere
# steps run eagerly, as in part one.
# A replay reads and writes the addresses it recorded: the runner's static buffers, the KV pool,
# and one memory pool that every graph's activations share. A decode step's size is its batch
# size, a prompt step's its token count. A step pads its batch to the next captured size
# (pa.cuda_graph_sizes, pa.graph_key); _pad says why the padding is harmless. No step outgrows
# the captured sizes: the largest are max_num_seqs and max_num_batched_tokens, which bound every
# step. In prepare's worked step, 41 tokens with a prompt among them replay the 48-token graph:
# _pad adds seven -1 slots, 46 context_lens of 0 and 46 cu_seqlens_q of 41. The host's
# block_tables keep their width of 5; the kernels see the graph's full width.
# Extends: ModelRunner (allocate_kv_cache captures once the pool is bound; put_step pads;
# forward replays). The tensor-parallel workers replay rank 0's.

class CUDAGraphRunner(ModelRunner):
    def __init__(self, cfg: Config):
        self.graphs: dict[tuple, tuple] = {}       # (is_decode, size) -> (CUDAGraph, its output)
        self.graph_sizes = {True: [], False: []}   # the captured sizes of each kind
        super().__init__(cfg)

    def allocate_kv_cache(self) -> int:
        num_blocks = super().allocate_kv_cache()
        self.capture_cuda_graphs()                 # the pool's addresses are fixed now
        return num_blocks

    def put_step(self, flat: dict, N: int, S: int, width: int, is_decode: bool) -> tuple:
        key = pa.graph_key(self.graph_sizes, is_decode, N)   # None: no graph; runs eagerly
        if key is not None:
            N, S, width = self._pad(flat, key, N, S)
        return super().put_step(flat, N, S, width, is_decode)

    def forward(self, input_ids, positions, meta: AttentionMetadata):
        graph = self.graphs.get((meta.is_decode, input_ids.shape[0]))   # padded to its size
        if graph is None:
            return super().forward(input_ids, positions, meta)
        graph[0].replay()                   # every kernel of the forward pass, one launch
        return graph[1]

    def _pad(self, flat: dict, key: tuple, num_tokens: int, num_seqs: int) -> tuple:
        """Pad flat to graph key's N rows and S sequences; return them and the block-table width
        the kernels see. The contract: each padded value, and why it is harmless:
          slot_mapping  -1 for rows past the real tokens: rope_store writes no slot
          context_lens  0 for sequences past the real ones: attention reads no key
          cu_seqlens_q  the real token count for them: they own no query rows
          block_tables  the graph's full width; ids past a row's own blocks are stale
                        and never read (the kernels stop at its context_len)
          input_ids, positions   stale in padding rows: computed, never stored, and
                        their outputs are dropped (hidden[:num_tokens] in launch)"""
        N = key[1]
        S = N if key[0] else min(N, self.cfg.max_num_seqs)   # decode: one sequence per row
        flat["slot_mapping"] += [-1] * (N - num_tokens)
        flat["context_lens"] += [0] * (S - num_seqs)
        flat["cu_seqlens_q"] += [num_tokens] * (S - num_seqs)
        return N, S, self.max_blocks_per_seq

    @torch.no_grad()
    def capture_cuda_graphs(self):
        """Capture a graph of each size, where graphs run: on CUDA with the Triton attention (the
        torch attention reads lengths on the host, which no graph captures), unless
        --enforce-eager. The profile step that sized the pool ran eagerly before: the graphs'
        shared pool holds the same activations, no more."""
        cfg = self.cfg
        if not self.use_cuda or cfg.enforce_eager or cfg.attention != "triton":
            return
        sizes = pa.cuda_graph_sizes(cfg.max_num_seqs, cfg.max_num_batched_tokens)
        keys = sorted(((kind, n) for kind in (True, False) for n in sizes[kind]),
                      key=lambda key: -key[1])   # largest first: the others reuse its memory
        pool = None                            # one memory pool, shared by every graph
        for key in keys:
            # A step of no tokens, all padding (_pad): the captures write and read nothing.
            flat = dict(slot_mapping=[], context_lens=[], cu_seqlens_q=[0])
            args = ModelRunner.put_step(self, flat, *self._pad(flat, key, 0, 0), key[0])
            self.model(*args)                   # warm-up: compiles this size's kernels
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                hidden = self.model(*args)
            pool = graph.pool()
            self.graphs[key] = (graph, hidden)
            _progress(f"captured CUDA graphs {len(self.graphs)}/{len(keys)}")
        self.graph_sizes = sizes               # from here on, steps replay them
        _progress(f"captured {len(keys)} CUDA graphs", end=True)
        torch.cuda.empty_cache()               # the warm-ups' memory: graphs use their pool

# ---------------------------------------------------------------------------
# Chapter: the engine core process
# Part one's server steps the engine core in a thread of the server's process. Here, the default,
# it runs in the main thread of a process of its own. So no per-request Python work (JSON, SSE,
# detokenizing) competes with its step loop for the GIL. LLM.generate needs none of this: its
# engine core runs in the caller's thread. Who runs where:
#
#     process      thread                  runs
#     server       main (the event loop)   the handlers and response shapes (Server), and
#                                          _deliver: FrontEnd.process, each request's queue
#     server       engine-core-inputs      _send_all: requests and aborts into the inbox pipe
#     server       engine-core-outputs     receive_outputs: the outbox pipe, to the event loop
#     engine core  main                    run_engine_core: the step loop, which owns the device
#     engine core  one sender              the outputs into the outbox pipe
#
# Two pipes join the processes. Into the engine core go lists of EngineCoreRequest and
# EngineCoreAbort. Out of it come its stats once it is ready (or why it failed), then one
# EngineCoreOutputs per turn of its loop. Closing the inbox stops it.
# Extends: EngineCoreClient (start_engine_core spawns the process; start, with the event loop,
# the thread that receives its outputs; shutdown).

@dataclass
class EngineCoreOutputs:
    """What one turn of the engine core's loop sends back: a step's outputs, or none."""
    outputs: list                     # EngineCoreOutput: one per token kept, one per failure
    stats: dict                       # EngineCore.stats() after the step (for /metrics)

def run_engine_core(cfg: Config, inbox, outbox, setup=None):
    """The engine core process's main thread. It owns the scheduler, the BlockAllocator, the
    ModelRunner and the device, and steps while work is queued. `setup(core)` runs first if given
    (tests inject faults)."""
    follow_parent(outbox)          # chapter: faults (Ctrl-C is the server's; its death ends us)
    faulthandler.enable()                          # a crash in native code leaves a trace
    try:
        core = DefaultEngineCore(cfg)
        exit_on_worker_death(core.runner.workers)       # chapter: tensor parallelism
        if setup is not None:
            setup(core)
    except Exception as e:
        outbox.send(f"the engine core failed to start: {e}")
        return
    # The outputs go out through one worker thread, in order: the step loop never waits on the
    # server (with both pipes full, the two processes would wait on each other).
    sender = ThreadPoolExecutor(max_workers=1)
    sender.submit(outbox.send, EngineCoreOutputs([], core.stats()))   # ready; no server: safe
    while True:
        try:   # block only when idle; while sequences run, take what has arrived
            messages = [] if core.has_unfinished() else [inbox.recv()]
            while inbox.poll():
                messages.append(inbox.recv())
        except (EOFError, OSError):           # the server closed its end, or is gone
            return
        outputs = []
        for item in (item for message in messages for item in message):   # in the order sent
            if isinstance(item, EngineCoreAbort):
                core.abort_request(item.request_id)
                continue
            try:
                core.add_request(item)
            except Exception as e:            # fails only this request
                traceback.print_exc()
                outputs.append(EngineCoreOutput(item.request_id, None, finish_reason="error",
                                                error=f"add_request failed: {e!r}"))
        if core.has_unfinished():
            try:
                outputs += core.step()
            except Exception as e:            # fails the running requests, not the process
                traceback.print_exc()
                outputs += fail_running(core, e)            # chapter: faults
        sender.submit(outbox.send, EngineCoreOutputs(outputs, core.stats())) # gone: EOF above
        exit_on_failed_step(core.runner.workers, sender)      # chapter: tensor parallelism

# -- the server's end of the pipes: start, send, receive, stop --
class EngineCoreProcessClient(EngineCoreClient):
    """Part one's client, with the engine core in a process of its own. Its requests and aborts
    go from `outgoing` into the inbox pipe (_send_all), and its outputs come back with its stats
    (receive_outputs). setup(core), if given, runs in that process first (tests inject faults)."""
    stats = None                           # EngineCore.stats(), as the engine core last sent

    def __init__(self, cfg: Config, setup=None):
        self.setup = setup
        super().__init__(cfg)

    def start_engine_core(self, cfg: Config) -> int:
        self.stats = start_engine_core(self, cfg, self.setup)
        return self.stats["kv_blocks_total"]

    def start(self, loop: asyncio.AbstractEventLoop):
        threading.Thread(target=receive_outputs, args=(self, loop), name="engine-core-outputs",
                         daemon=True).start()

    def shutdown(self):
        stop_engine_core(self)

    def _deliver_messages(self, messages: list):
        """On the event loop: what receive_outputs brought, one or more EngineCoreOutputs."""
        self.stats = messages[-1].stats
        self._deliver([o for m in messages for o in m.outputs])

def start_engine_core(client: EngineCoreClient, cfg: Config, setup=None) -> dict:
    """Spawn the engine core process with its two pipes (client.process, client.inbox,
    client.outbox) and wait until it has loaded. Returns its first stats, and starts the thread
    that empties client.outgoing into the inbox (_send_all)."""
    ctx = multiprocessing.get_context("spawn")   # CUDA cannot be forked
    inbox_end, client.inbox = ctx.Pipe(duplex=False)     # server -> engine core
    client.outbox, outbox_end = ctx.Pipe(duplex=False)   # engine core -> server
    client.process = ctx.Process(target=run_engine_core, name="nanoserve-engine-core",
                                 args=(cfg, inbox_end, outbox_end, setup), daemon=True)
    with child_stopped_on_error(client.process, client.outbox):   # chapter: faults (Ctrl-C)
        with sigint_held():                # chapter: faults (Ctrl-C is the server's)
            client.process.start()
        inbox_end.close()                  # the child's ends, closed here: a dead child
        outbox_end.close()                 # then reads as EOF
        try:
            ready = client.outbox.recv()   # stats once loaded, or why it failed
        except EOFError:
            client.process.join(5)
            ready = f"the engine core exited with code {client.process.exitcode}"
    if isinstance(ready, str):
        raise ValueError(ready)
    threading.Thread(target=_send_all, args=(client.inbox, client.outgoing),
                     name="engine-core-inputs", daemon=True).start()
    return ready.stats

def stop_engine_core(client: EngineCoreClient):
    client.outgoing.put(None)              # after the sends queued before: EOF over there
    client.process.join(10)
    if client.process.is_alive():
        client.process.kill()

def _send_all(inbox, outgoing: queue.SimpleQueue):
    """The sending thread, so that the event loop never blocks on a pipe full mid-step. Each
    message takes all that waits, in order: one message per request, at a burst, would queue
    each behind the last for the GIL, which the busy event loop holds."""
    items = []
    with contextlib.suppress(OSError):     # the engine core is gone: receive_outputs says so
        while None not in items:           # None: shut down, after all queued before it
            items = [outgoing.get()]
            while not outgoing.empty():
                items.append(outgoing.get())
            inbox.send([x for item in items if item is not None for x in item])
    inbox.close()

def receive_outputs(client: EngineCoreClient, loop: asyncio.AbstractEventLoop):
    """The receiving thread, started with the event loop. It blocks on the pipe without the GIL,
    and hands `loop` all that has arrived in one call (client._deliver). (A reader on the loop
    would need the pipe non-blocking, as uvloop makes it, and would get messages in pieces.)"""
    with contextlib.suppress(RuntimeError):   # the loop is closed: the server stopped
        try:
            while True:
                messages = [client.outbox.recv()]
                while client.outbox.poll():
                    messages.append(client.outbox.recv())
                loop.call_soon_threadsafe(client._deliver_messages, messages)
        except (EOFError, OSError):
            loop.call_soon_threadsafe(engine_died, client)   # chapter: faults

# ---------------------------------------------------------------------------
# Chapter: incremental detokenization
# Part one decodes each request's tokens again, whole, at every step: a long stream's cost grows
# with the square of its length. Here each request keeps a window of the tokens last shown, and a
# step decodes only the window and what came after it. The window's first tokens give the new
# ones their context, since a token may render differently after another (a leading space). So
# the text is the same as part one's.
# Extends: RequestState (the window's offsets), FrontEnd (_detokenize).

class IncrementalRequestState(RequestState):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # the window, as indices (slices would copy the whole token_ids every step)
        self.prefix_offset = self.read_offset = self.num_read_chars = 0   # [prefix, read): shown

class IncrementalFrontEnd(FrontEnd):
    state_class = IncrementalRequestState

    def _detokenize(self, states: list):
        """Part one's text, made by appending each request's newly completed text, all requests
        in one batched decode. The shown tokens [prefix_offset, read_offset) are decoded again
        as context, then with the new ones. Say tokens 0-4 are shown (offsets 3, 5), and 5-6
        arrive. decode(3:5) = "ab" and decode(3:) = "abcd", so "cd" is added, and the offsets
        become 5, 7. Text that ends in U+FFFD (half a character) is added up to it, and the
        offsets wait for the token that ends it (num_read_chars: len(text) when they last
        moved). At the end, all is added."""
        if self.tokenizer is None or not states:
            return
        windows = [w for s in states for w in (s.token_ids[s.prefix_offset:s.read_offset],
                                                s.token_ids[s.prefix_offset:])]
        texts = self.tokenizer.decode_batch(windows, skip_special_tokens=True)
        for s, before, after in zip(states, texts[0::2], texts[1::2]):
            done = after if s.finish_reason else after.rstrip("\ufffd")   # whole characters
            s.text += done[len(before) + len(s.text) - s.num_read_chars:]
            if len(after) > len(before) and done == after:   # no half character: move on
                s.prefix_offset, s.read_offset = s.read_offset, len(s.token_ids)
                s.num_read_chars = len(s.text)

# ---------------------------------------------------------------------------
# Chapter: stop strings
# A request's stop strings end its text where the first of them begins; the text and the tokens
# past it are dropped. The engine core sees only token ids, so the front end finds them, and a
# request they end is aborted in the engine core (FrontEnd.process's `stopped`). A stop string
# may span tokens, and several tokens may arrive in one call of process (steps batched behind
# the server, or a chapter's accepted drafts). So the text is kept per step (incremental), each
# call's new text is searched with the few characters before it, and a stream holds back the
# tail of its text that could still grow into a stop string (take_delta).
# Extends: SamplingParams (stop), RequestState (incremental; take_delta holds the tail), FrontEnd
# (process ends a request at its stop string, and names it to abort).

@dataclass
class StopStringParams(SamplingParams):
    stop: Optional[list] = _flag(None, "a string that ends the text, not included (repeatable)")

    def __post_init__(self):
        super().__post_init__()
        self.stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

class StopStringRequestState(RequestState):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.incremental = self.incremental or bool(self.params.stop)   # text at every step

    def take_delta(self) -> Delta:
        """Part one's, less the tail of the text that could still begin a stop string: until
        the request ends, part one's sees the text without it."""
        tail = max((len(s) - 1 for s in self.params.stop), default=0)
        if self.finish_reason is not None or tail == 0:
            return super().take_delta()
        text, self.text = self.text, self.text[:max(self.num_sent_chars, len(self.text) - tail)]
        try:
            return super().take_delta()
        finally:
            self.text = text

class StopStringFrontEnd(FrontEnd):
    state_class = StopStringRequestState

    def process(self, outputs: list) -> tuple[list, list]:
        """Part one's, then each changed request with stop strings ended at the first, and named
        to abort if the engine core still runs it."""
        num_chars = {}                         # request id -> its chars before these outputs
        for out in outputs:
            if (state := self.states.get(out.request_id)) is not None:
                num_chars.setdefault(out.request_id, len(state.text))
        states, stopped = super().process(outputs)
        for state in states:
            if state.params.stop and end_at_stop_string(self, state, num_chars[state.request_id]):
                stopped.append(state.request_id)
                del self.states[state.request_id]
                state.finish_time = time.perf_counter()
        return states, stopped

def end_at_stop_string(front: FrontEnd, state: RequestState, num_old_chars: int) -> bool:
    """End state at its earliest stop string, if its text holds one now: cut it ("stop"). Every
    token is checked, the last too, so a stop string at max_tokens still ends in "stop". True if
    the engine core still runs the request (to abort)."""
    if state.error or not _truncate_at_stop_string(front, state, num_old_chars):
        return False
    running, state.finish_reason = state.finish_reason is None, "stop"
    return running

def _truncate_at_stop_string(front: FrontEnd, state: RequestState, num_old_chars: int) -> bool:
    """Cut the text at the earliest stop string; a new match ends inside this call's text.
    Several tokens may arrive in one call (steps batched behind the server, or a chapter's
    accepted drafts). Those after the token that completes the stop string are cut too (and
    their log-probs, by LogprobsFrontEnd): the output is the same as if they had come one at a
    time."""
    matches = [(i, i + len(stop)) for stop in state.params.stop
               if (i := state.text.find(stop, max(0, num_old_chars - len(stop) + 1))) != -1]
    if not matches:
        return False
    first, end = min(matches)
    n = len(state.token_ids)   # walk back to the fewest whose text holds the match
    while n > 1 and front.decode(state.token_ids[:n - 1]).startswith(state.text[:end]):
        n -= 1
    del state.token_ids[n:]
    state.text = state.text[:first]
    return True

# ---------------------------------------------------------------------------
# Chapter: prefix caching
# Many prompts begin alike: a system prompt, a chat's earlier turns, a few-shot preamble. The K/V
# of a token depend only on it and the tokens before it. So a full block is named by a hash of
# its whole prefix (prefix_hash), and a sequence admitted later points its block table at the
# named blocks of its longest cached prefix. It computes only the rest, and those blocks are
# shared: their reference counts go above 1.
# The names live in the allocator. A named block that no one uses is evictable: it stays
# findable until the pool needs it, and the least recently used goes first. A finished
# sequence's blocks are freed tail first (Scheduler._free_blocks), so a prefix's head, which
# more prompts share, outlives its tail.
# Extends: BlockAllocator (names, evictable blocks), Sequence (its blocks' hashes), Scheduler
# (_admit reuses a prefix; finish names the blocks before they are freed), EngineCore (_commit
# names the blocks each step fills; _append_token reports the prompt tokens found, on an
# EngineCoreOutput of its own), RequestState and FrontEnd (process: that count, num_cached_tokens,
# as vLLM's RequestOutput has it).

class PrefixCachingAllocator(BlockAllocator):
    def __init__(self, num_blocks: int):
        super().__init__(num_blocks)
        self.block_hashes: list[Optional[int]] = [None] * num_blocks  # a full block's prefix hash
        self.evictable: OrderedDict[int, None] = OrderedDict()  # ref 0 but named; LRU first
        self.cached_blocks: dict[int, int] = {}          # prefix hash -> block id

    num_free_blocks = property(lambda self: len(self.free_block_ids) + len(self.evictable))

    def allocate(self) -> int:
        if not self.free_block_ids:   # evict the least recently used named block
            block, _ = self.evictable.popitem(last=False)  # the oldest first
            del self.cached_blocks[self.block_hashes[block]]
            self.block_hashes[block] = None
            self.free_block_ids.append(block)
        return super().allocate()

    def free(self, block: int):
        if self.block_hashes[block] is None:
            return super().free(block)
        assert self.ref_counts[block] > 0, f"block {block} freed twice"
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            self.evictable[block] = None             # most recently used goes last

    def lookup(self, prefix_hash: int) -> Optional[int]:
        return self.cached_blocks.get(prefix_hash)

    def share(self, block: int):
        """Take one more reference to a named block (revive it if evictable)."""
        if self.ref_counts[block] == 0:
            del self.evictable[block]
        self.ref_counts[block] += 1

    def cache(self, block: int, prefix_hash: int):
        """Name a full block by its prefix hash; the first block with a name keeps it."""
        if self.block_hashes[block] is None and prefix_hash not in self.cached_blocks:
            self.block_hashes[block] = prefix_hash
            self.cached_blocks[prefix_hash] = block

class PrefixCachingSequence(Sequence):
    def __init__(self, *args):
        super().__init__(*args)
        self.block_hashes = []       # the hash of each full block of token_ids, in order
        self.num_named_blocks = 0    # block_table's first blocks, named in the allocator
        self.num_cached_tokens = 0   # prompt tokens whose K/V were found, not computed

def prefix_hash(parent: Optional[int], token_ids) -> int:
    """Name a full block by its tokens and, through the parent's hash (None for the first block),
    everything before it. A name lives as long as the process: no other run needs to agree."""
    return hash((parent, tuple(token_ids)))

def _hash_full_blocks(seq: Sequence, bs: int):
    for i in range(len(seq.block_hashes), seq.num_tokens // bs):
        parent = seq.block_hashes[-1] if seq.block_hashes else None
        seq.block_hashes.append(prefix_hash(parent, seq.token_ids[i * bs:(i + 1) * bs]))

class PrefixCachingScheduler(Scheduler):
    def __init__(self, cfg: Config, allocator: BlockAllocator):
        super().__init__(cfg, allocator)
        self.num_cached_tokens = self.num_prompt_tokens = 0   # admitted, and of those cached

    def _admit(self, seq: Sequence, budget: int) -> int:
        """Part one's admission, after pointing seq at the cached blocks of its prefix."""
        self.reuse_cached_prefix(seq)
        n = super()._admit(seq, budget)
        if n == 0:
            self._free_blocks(seq)         # give back the shared prefix; retry later
            return 0
        self.num_cached_tokens += seq.num_computed_tokens   # its cached tokens: none launched yet
        self.num_prompt_tokens += seq.num_tokens
        # no output yet: a recompute keeps its first count (a prompt preempted mid-prefill then
        # counts its own named blocks as hits)
        if seq.num_tokens == seq.num_prompt_tokens:
            seq.num_cached_tokens = seq.num_computed_tokens
        return n

    def reuse_cached_prefix(self, seq: Sequence):
        """Point seq at the cached blocks of its longest cached prefix; they are named already."""
        seq.num_named_blocks = 0
        if not self.cfg.enable_prefix_caching or seq.params.prompt_logprobs is not None:
            return        # chapter: log-probs and logit edits (prompt log-probs need every row)
        bs, allocator = self.block_size, self.allocator
        _hash_full_blocks(seq, bs)
        # Leave the last token out: computed for its logits, its K/V must never enter a shared block
        for h in seq.block_hashes[:(seq.num_tokens - 1) // bs]:
            block = allocator.lookup(h)
            if block is None:
                break
            allocator.share(block)
            seq.block_table.append(block)
        seq.num_named_blocks = len(seq.block_table)
        seq.num_computed_tokens = seq.num_named_blocks * bs

    def name_computed_blocks(self, seq: Sequence):
        """After a step is read back, name the blocks just filled. One may still be being written by
        a step launched after it (num_computed_tokens counts launched ones), which is safe: a step
        reading it via a prefix-cache hit is launched later on the same CUDA stream, so runs after
        the write. Only read-back tokens are hashed (a pending one is not in token_ids)."""
        bs = self.block_size
        if not self.cfg.enable_prefix_caching or seq.num_computed_tokens // bs <= \
                seq.num_named_blocks:
            return                          # no block filled since the last call: most steps
        _hash_full_blocks(seq, bs)
        num_full = min(seq.num_computed_tokens // bs, len(seq.block_hashes))
        for i in range(seq.num_named_blocks, num_full):   # only the newly full ones
            self.allocator.cache(seq.block_table[i], seq.block_hashes[i])
        seq.num_named_blocks = max(seq.num_named_blocks, num_full)

    def finish(self, seq: Sequence, reason: str):
        if reason != "abort":
            self.name_computed_blocks(seq)    # before the free: a named block stays findable
        super().finish(seq, reason)

@dataclass
class PrefixCachingOutput(EngineCoreOutput):
    num_cached_tokens: int = 0        # the request's prompt tokens found in the pool

class PrefixCachingEngineCore(EngineCore):
    def _append_token(self, seq: Sequence, token: int, *row) -> EngineCoreOutput:
        """Part one's, its output saying how many prompt tokens were found in the pool."""
        out = super()._append_token(seq, token, *row)
        out.num_cached_tokens = seq.num_cached_tokens
        return out

    def stats(self) -> dict:
        s = self.scheduler
        return super().stats() | dict(
            kv_blocks_cached=len(self.allocator.evictable),   # free, but their prefix kept
            prompt_tokens_total=s.num_prompt_tokens,          # admitted, and of those cached
            prefix_cache_hit_tokens_total=s.num_cached_tokens,
            prefix_cache_hit_rate=s.num_cached_tokens / max(1, s.num_prompt_tokens))

    def _commit(self, step: LaunchedStep):
        super()._commit(step)
        for seq in step.batch.seqs:
            if not seq.is_finished:              # (a finished one named its blocks at the end)
                self.scheduler.name_computed_blocks(seq)

class PrefixCachingRequestState(RequestState):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.num_cached_tokens = 0    # its prompt tokens found in the pool (vLLM's RequestOutput)

class PrefixCachingFrontEnd(FrontEnd):
    def process(self, outputs: list) -> tuple[list, list]:
        """Part one's, and each request's count of prompt tokens found in the pool."""
        for out in outputs:
            if out.finish_reason != "error" and out.num_cached_tokens and \
                    (state := self.states.get(out.request_id)) is not None:
                state.num_cached_tokens = out.num_cached_tokens
        return super().process(outputs)

# ---------------------------------------------------------------------------
# Chapter: the burst rule
# At a burst, waiting prompts fill whole steps. Then decodes ride along only every
# DECODES_EVERY-th step. A decode costs about as much in a full prompt step as alone, since its
# K/V is read either way. So its cost is paid in one step of those, prompts get the rest sooner,
# and streams still move (README, Speed).
# Extends: Scheduler (_schedule_running leaves the decodes out of a step in which they wait).

class BurstRuleScheduler(Scheduler):
    DECODES_EVERY = 4     # at a burst, decodes ride along every 4th step
    num_steps = 0         # steps scheduled

    def _schedule_running(self, batch: ScheduledBatch, budget: int, seqs: list) -> int:
        """While decodes wait, only the running sequences still in their prompt run: not one
        past it (a decode, or a preempted one recomputing its output)."""
        self.num_steps += 1
        if self.decodes_wait_at_burst(budget):
            seqs = [seq for seq in seqs if seq.num_computed_tokens < seq.num_prompt_tokens]
        return super()._schedule_running(batch, budget, seqs)

    def decodes_wait_at_burst(self, budget: int) -> bool:
        """True if decodes sit this step out for prompts, while prompts can take their place. That
        needs a free seat, prompts enough to fill a step, and room in the pool for two full steps
        of prompt tokens. With less room, admission would soon stop on blocks, and the decodes
        would wait for nothing."""
        if self.num_steps % self.DECODES_EVERY == 0:
            return False                          # this step, decodes ride along
        seat_free = len(self.running) < self.cfg.max_num_seqs
        room = self.allocator.num_free_blocks * self.block_size >= 2 * budget
        fills_step = sum(seq.num_tokens for seq in self.waiting) >= budget
        return seat_free and room and fills_step

# ---------------------------------------------------------------------------
# Chapter: speculative decoding
# A decode step reads every weight for one token per row. At a small batch it can check several
# tokens for about the same cost. With num_speculative_tokens = k, a decoding row guesses up to k
# next tokens, its drafts, and one step checks them all. Four parts:
# - draft: prompt lookup, what followed the last few tokens where they occurred (NgramIndex);
# - verify: the row's newest token and its drafts run as one causal chunk, and every row of the
#   chunk samples (ModelRunner._flatten);
# - accept: the drafts up to the first that differs from the token sampled at its place are
#   kept, and that sampled token too (num_accepted);
# - rewind: num_computed_tokens moves back past the rejected drafts. Their K/V is overwritten
#   later, and blocks held only for them go back to the pool. No prefix hash covers them, since
#   only read-back tokens are hashed.
# One step, k = 3, token_ids ending "... sat on the", num_computed_tokens L - 1 (L tokens). "on
# the" came before, followed by "mat . The": those are the drafts. The chunk [the, mat, ., The]
# runs at positions L-1..L+2 and samples [mat, ., It, cat]. Two drafts agree, so "mat . It" is
# appended: 3 tokens for one step. num_computed_tokens went to L + 3 at launch, and back by the
# rejected draft to L + 2, which is len(token_ids) - 1, as always.
# The pending count (the table of chapter "async scheduling") changes with drafts. A row with d
# drafts samples d + 1 rows, so it holds 1 + d pending tokens between its launch and its commit.
# Sampling is exact too. A draft is kept iff the row's draw x from p equals it, which happens
# with probability p(draft). A rejected row emits x, a draw from p without the draft,
# renormalized. That is the standard rule for a deterministic draft: the output is distributed
# as plain sampling. A seeded row's draw is keyed by its position (Sampler), so drafts change no
# seeded output either.
# Rows with a grammar or a penalty do not draft: their masks or counts would need the drafts
# before them. No row drafts while more than SPECULATE_MAX_ROWS run, where a verify step costs
# well over a decode (README). Drafts take only the budget and the blocks left once every row is
# scheduled (add_drafts).
# Async scheduling's overlap is kept. Step N+1 is laid out while step N, which may have drafted, is
# still on the device. So the host knows neither the pending token nor how many drafts step N
# keeps. Two guesses stand in:
# - the tokens: the lookup guesses the pending tokens as it guesses drafts, and drafts after the
#   guess (guess_pending). A wrong guess makes wrong drafts, which are rejected: never wrong text.
# - the places: each row is laid out as if step N kept every draft. Before the forward pass, the
#   device moves it back by the drafts step N rejected (follow_accepted_drafts). Its input becomes
#   the token sampled after the last kept draft. Its positions, slots and context length move
#   back by the count rejected. When step N is read back, accept rewinds the host to match.
# On the CPU the host runs the forward pass itself, so there is nothing to hide. There a step
# after one that drafted reads it back first, and drafts on no guess.
# Extends: Sequence (its n-gram index and guess), Scheduler (schedule adds the drafts),
# ModelRunner (_flatten lays out the drafts; prepare follows the accepted ones), EngineCore
# (_read_back keeps the accepted rows; _step_before reads a drafting step back first where rows
# do not follow it on the device). SpeculativeRunner's __init__ holds k <= 15: a row's 1 + k
# rows fit the 16-wide tile of pa.follow_accepted and follow_accepted_drafts' 16 columns.

class SpeculativeSequence(Sequence):
    def __init__(self, *args):
        super().__init__(*args)
        self.ngrams = NgramIndex()   # where each n-gram of token_ids occurred last
        self.guessed = (0, [])       # (len(token_ids), the pending tokens guessed), last draft

class SpeculativeScheduler(Scheduler):
    def __init__(self, cfg: Config, allocator: BlockAllocator):
        super().__init__(cfg, allocator)
        self.speculation = Speculation(cfg, self)

    def schedule(self) -> ScheduledBatch:
        """Part one's batch, then drafts from what is left of the budget (add_drafts). A batch
        carries them in draft_token_ids: seq -> its drafts."""
        batch = super().schedule()
        batch.draft_token_ids = {}
        self.speculation.add_drafts(batch, self.cfg.max_num_batched_tokens
                                    - sum(batch.num_new_tokens))
        return batch

class NgramIndex:
    """A sequence's drafts (this chapter's opening tells the mechanism).
    extend(token_ids) enters each position once, when the token after it is known: a step costs
    a few dict operations, not a scan of the context.
    propose(token_ids, k): the up to k tokens that followed the latest earlier occurrence of
    the last n tokens, n from NGRAM_MAX down to NGRAM_MIN. With k = 3, in [5, 7, 9, 2, 5, 7]
    the last 3 tokens occurred nowhere before; the last 2 (5, 7) end at position 2, so the
    draft is [9, 2, 5]. token_ids may end in guessed tokens: they are matched, never entered."""
    NGRAM_MIN, NGRAM_MAX = 2, 3   # n-gram lengths matched, the longest tried first

    def __init__(self):
        self.ends = {}          # n-gram (a tuple) -> the position just past its latest occurrence
        self.num_indexed = 1    # positions below this are entered

    def extend(self, token_ids):
        for end in range(self.num_indexed, len(token_ids)):   # each has a token after it
            for n in range(self.NGRAM_MIN, min(self.NGRAM_MAX, end) + 1):
                self.ends[tuple(token_ids[end - n:end])] = end
        self.num_indexed = max(self.num_indexed, len(token_ids))

    def propose(self, token_ids, k):
        for n in range(min(self.NGRAM_MAX, len(token_ids)), self.NGRAM_MIN - 1, -1):
            end = self.ends.get(tuple(token_ids[-n:]))
            if end is not None:
                return token_ids[end:end + k]
        return []

def num_accepted(draft_token_ids: list, sampled: list) -> int:
    """How many drafts a row keeps: those before the first that differs from the token sampled at
    its place (sampled[j] is the token drawn where draft j stands)."""
    return next((j for j, (d, x) in enumerate(zip(draft_token_ids, sampled)) if d != x),
                len(draft_token_ids))

class Speculation:
    """The scheduler's drafts and the engine core's accept and rewind, with their counters. One
    per Scheduler (its seam); it reads the scheduler's running rows and pool."""
    SPECULATE_MAX_ROWS = 16   # drafts only while at most 16 rows run

    def __init__(self, cfg: Config, scheduler: Scheduler):
        self.cfg, self.scheduler = cfg, scheduler
        self.in_flight = {}       # the drafts of the step scheduled last, by sequence (on the
                                  # device while the next step is scheduled)
        # Whether rows follow a drafting step on the device, or it is read back first (the
        # opening's last paragraph; tensor-parallel ranks lay out their own inputs, so not there)
        self.follows_on_device = cfg.device != "cpu" and cfg.tensor_parallel_size == 1 \
            and cfg.async_scheduling
        self.num_draft_tokens = self.num_accepted_tokens = 0

    def add_drafts(self, batch: ScheduledBatch, budget: int):
        """Give the decoding rows of a scheduled batch their drafts, from what every row left of the
        budget and the free blocks: a draft never preempts a row or keeps one from running."""
        sched, k = self.scheduler, self.cfg.num_speculative_tokens
        speculates = 0 < k and len(sched.running) <= self.SPECULATE_MAX_ROWS
        for i, seq in enumerate(batch.seqs if speculates else []):
            drafts = self.draft(seq, min(budget, k))
            while drafts and sched._num_blocks_needed(seq, 1 + len(drafts)) > \
                    sched.allocator.num_free_blocks:
                drafts.pop()                    # their blocks must be free already
            if drafts:
                sched._reserve_blocks(seq, 1 + len(drafts))
                batch.draft_token_ids[seq] = drafts
                batch.num_new_tokens[i] += len(drafts)
                budget -= len(drafts)
        self.in_flight = batch.draft_token_ids

    def draft(self, seq: Sequence, k: int) -> list:
        """Up to k drafts for seq, if it decodes. Accepting them all stays within the length
        limits, counting its pending tokens as if the step before keeps every draft."""
        num_tokens = seq.num_tokens + seq.num_pending_tokens
        if seq.num_computed_tokens != num_tokens - 1 or seq.matcher is not None \
                or seq.params.needs_output_history:
            return []      # a prefill chunk, or a row with a grammar or a penalty (the opening)
        k = min(k, self.cfg.max_model_len - num_tokens - 1,
                seq.params.max_tokens - (num_tokens - seq.num_prompt_tokens) - 1)
        seq.ngrams.extend(seq.token_ids)
        guess = self.guess_pending(seq)
        seq.guessed = (seq.num_tokens, guess)
        return seq.ngrams.propose(seq.token_ids + guess, k) if k > 0 and guess is not None else []

    def guess_pending(self, seq: Sequence) -> Optional[list]:
        """The host's guess of seq's pending tokens: [] when it has none. Else the drafts of the
        step still on the device, if they were drafted on a guess that came true, then what the
        lookup says follows them. None when the lookup has nothing to say."""
        if seq.num_pending_tokens == 0:
            return []
        at, guessed = seq.guessed          # what the last draft assumed after token_ids[:at]
        kept = self.in_flight.get(seq, []) if seq.token_ids[at:] == guessed else []
        last = seq.ngrams.propose(seq.token_ids + kept, 1)
        return kept + last if last else None

    def reads_back_first(self, prev: LaunchedStep) -> bool:
        """Whether AsyncEngineCore.step reads prev back before it launches the next step: after a
        step that drafted, where rows do not follow it on the device (follows_on_device)."""
        return not self.follows_on_device and bool(prev.batch.draft_token_ids)

    def kept_rows(self, rows, step: LaunchedStep, after):
        """EngineCore._commit's (seq, row) pairs for a step with drafts: of each sequence's sampled
        rows, those it keeps (accept), in order."""
        rows = iter(rows)
        for seq, row in rows:
            for kept in self.accept(seq, row, rows, step, after):
                yield seq, kept

    def accept(self, seq: Sequence, row: tuple, rows, step: LaunchedStep, after) -> tuple:
        """The rows kept of seq, whose first sampled row in `step` is `row`: that row alone without
        drafts. With d drafts, the next d of `rows` are seq's too. The kept ones are returned, and
        the rest rewound (the chapter's opening); _commit counts off a pending token for each row
        kept, and this for each rejected. `after` is the step launched since, whose rows the
        device has moved back already: its draws' positions follow here."""
        drafts = step.batch.draft_token_ids.get(seq)
        if not drafts:
            return (row,)
        sampled = (row, *(next(rows)[1] for _ in drafts))  # (token, *log-probs) each
        num_kept = num_accepted(drafts, [token for token, *_ in sampled])
        seq.num_pending_tokens -= len(drafts) - num_kept   # the rejected: read, never kept
        if seq.status == "running":         # (a finished or preempted one has no blocks left)
            self.num_draft_tokens += len(drafts)
            self.num_accepted_tokens += num_kept
            num_rejected = len(drafts) - num_kept
            seq.num_computed_tokens -= num_rejected
            if after is not None and after is not step:   # its seeds follow the device's move
                after.sample_positions = [p - num_rejected * (s is seq)
                                          for s, p in zip(after.seqs, after.sample_positions)]
            num_blocks = -(-seq.num_computed_tokens // self.cfg.block_size)   # ceil
            for block in reversed(seq.block_table[num_blocks:]):
                self.scheduler.allocator.free(block)
            del seq.block_table[num_blocks:]
        return sampled[:num_kept + 1]

    def stats(self) -> dict:
        return dict(spec_decode_num_draft_tokens_total=self.num_draft_tokens,
                    spec_decode_num_accepted_tokens_total=self.num_accepted_tokens)

def follow_accepted_drafts(runner: ModelRunner, batch: ScheduledBatch, pending: list,
                           prev: Optional[LaunchedStep]):
    """Move back, on the device, each row laid out as if prev kept all its drafts (the opening's
    places). In the opening's example the row's next input is "It", sampled at prev's row 2, not
    "cat" at row 3, and it moves back by 1. pa.follow_accepted reads prev's tokens on the
    device: no host round trip."""
    drafted = prev.batch.draft_token_ids if prev is not None else {}
    moved = [(row, seq) for row, seq in pending if seq in drafted] if drafted else []
    if not moved:
        return
    index = {seq: i for i, seq in enumerate(batch.seqs)}
    plan = [(prev.seqs.index(seq), len(drafted[seq]), row,    # seq's first sampled row in prev
             1 + len(batch.draft_token_ids.get(seq, [])), index[seq]) for row, seq in moved]
    drafts = [drafted[seq] + [-1] * (16 - len(drafted[seq])) for _, seq in moved]
    b, dev = runner.buffers, runner.device
    pa.follow_accepted(prev.tokens, pa.to_device(dev, plan, torch.int64),
                       pa.to_device(dev, drafts, torch.int64), b["input_ids"], b["positions"],
                       b["slot_mapping"], b["context_lens"], b["block_tables"],
                       runner.cfg.block_size)

class SpeculativeRunner(AsyncRunner):
    def __init__(self, cfg: Config):
        if not 0 <= (k := cfg.num_speculative_tokens) <= 15:     # before anything loads
            raise ValueError(f"num_speculative_tokens must be in [0, 15], got {k}")
        super().__init__(cfg)

    def _flatten(self, batch: ScheduledBatch):
        """AsyncRunner._flatten, with each drafting row's drafts after its newest token; each of
        its d + 1 last rows samples. A batch without drafts takes the plain loop."""
        drafted = getattr(batch, "draft_token_ids", None)   # (none in the memory profile's step)
        if not drafted:
            return super()._flatten(batch)
        bs, flat = self.cfg.block_size, dict(input_ids=[], positions=[], slot_mapping=[],
                                             context_lens=[], cu_seqlens_q=[0])
        input_ids, positions, slot_mapping, context_lens, cu_seqlens_q = flat.values()
        samples, pending, tables = [], [], []   # samples and pending: (row, seq)
        width = max(len(seq.block_table) for seq in batch.seqs)
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            drafts = drafted.get(seq, ())
            d = len(drafts)
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
            last_row = cu_seqlens_q[-1] + n - 1
            input_ids += seq.token_ids[start:end - d]
            if end - d > len(seq.token_ids):   # a pending token
                input_ids.append(0)                # a placeholder, filled on the device
                pending.append((last_row - d, seq))
            input_ids += drafts
            table = seq.block_table
            tables.append(table + [0] * (width - len(table)))   # the row's blocks, then 0s
            positions += range(start, end)
            slot_mapping += [table[p // bs] * bs + p % bs for p in range(start, end)]
            context_lens.append(end)
            cu_seqlens_q.append(last_row + 1)
            if end - d >= len(seq.token_ids):   # its last input is its newest token: it samples
                samples += [(row, seq) for row in range(last_row - d, last_row + 1)]
        flat["block_tables"] = np.array(tables, dtype=np.int32)   # (B, width)
        self.pending = pending
        return flat, samples

    def prepare(self, batch: ScheduledBatch) -> StepInputs:
        inputs = super().prepare(batch)
        follow_accepted_drafts(self, batch, self.pending, self.prev)
        return inputs

def with_drafts_accepted(speed_line):
    """generate's speed line (part one's speed_line), with drafts on ending in the share of the
    drafts accepted."""
    def line(llm: LLM, state: RequestState) -> str:
        if llm.front.cfg.num_speculative_tokens == 0:
            return speed_line(llm, state)
        stats = llm.stats()
        drafted = stats["spec_decode_num_draft_tokens_total"]
        accepted = stats["spec_decode_num_accepted_tokens_total"]
        return (f"{speed_line(llm, state)}, {accepted} of {drafted} drafts accepted "
                f"({accepted / max(1, drafted):.0%})")
    return line

class SpeculativeEngineCore(AsyncEngineCore):
    def stats(self) -> dict:
        return super().stats() | self.scheduler.speculation.stats()

    def _read_back(self, step: LaunchedStep):
        """Of each drafting sequence's sampled rows, those it keeps (Speculation.kept_rows)."""
        rows = super()._read_back(step)
        if not step.batch.draft_token_ids:
            return rows
        return self.scheduler.speculation.kept_rows(rows, step, self.launched)

    def _step_before(self) -> Optional[LaunchedStep]:
        """On the CPU or tensor-parallel, a step that drafted is read back before the next is
        laid out (Speculation.reads_back_first)."""
        prev = super()._step_before()
        if prev is not None and self.scheduler.speculation.reads_back_first(prev):
            self._commit(prev)
            return None
        return prev

# ---------------------------------------------------------------------------
# Chapter: log-probs and logit edits
# Three things a request may ask of the sampler beyond its draw. Log-probs: the model's own
# log-probability of each sampled token and of the k likeliest, as the OpenAI API reports them
# (before any edit, temperature or top-p). Prompt log-probs: the same for each prompt token,
# which runs the LM head over the prompt's rows. Logit edits: logit_bias, and the presence,
# frequency and repetition penalties, which read the tokens so far. They apply as sparse edits at
# (row, token) entries, never as a dense (B, V) bias (pa.apply_logit_edits).
# The server reads the fields (LogprobsServer) and writes the log-probs in each endpoint's shape.
# Extends: SamplingParams (the fields), RequestState, Delta and EngineCoreOutput (the log-probs),
# FrontEnd (validate: check_logit_params, and max_tokens 0 for the prompt's log-probs alone;
# process: the log-probs), Sequence (its prompt log-probs so far), ModelRunner (head:
# the prompt log-probs; draw: the edits; sample: the log-probs, copied back after the tokens),
# EngineCore (_append_token reports them, and drops the token of a prompt only scored),
# OpenAIServer (sampling_params; completion_shape and chat_shape, with completions' echo). A
# seam: reuse_cached_prefix (a request for prompt log-probs computes every prompt row).

@dataclass
class LogprobsParams(SamplingParams):
    logprobs: Optional[int] = None    # also return this many top log-probs per token
    prompt_logprobs: Optional[int] = None  # log-prob of each prompt token, + this many top
    logit_bias: dict = field(default_factory=dict)  # token id -> bias in [-100, 100]
    presence_penalty: float = 0.0     # OpenAI's, in [-2, 2]: minus this if generated before,
    frequency_penalty: float = 0.0    # and minus this times the count so far
    repetition_penalty: float = 1.0   # transformers': a seen token's logit / this (x this if < 0)

    needs_output_history = property(lambda self: bool(   # a penalty reads the tokens so far
        self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1))

def check_logit_params(p: SamplingParams, vocab_size: float):
    """The ranges of this chapter's SamplingParams fields; logit_bias's keys made ints."""
    for name, lo, hi in [("logprobs", 0, 20), ("prompt_logprobs", 0, 20),
                         ("presence_penalty", -2, 2), ("frequency_penalty", -2, 2)]:
        if getattr(p, name) is not None and not lo <= getattr(p, name) <= hi:
            raise ValueError(f"{name} must be in [{lo}, {hi}], got {getattr(p, name)}")
    if not 0 < p.repetition_penalty < math.inf:
        raise ValueError(f"repetition_penalty must be > 0, got {p.repetition_penalty}")
    try:        # JSON object keys are strings: {"1234": -100}
        p.logit_bias = {int(t): float(b) for t, b in (p.logit_bias or {}).items()}
    except (AttributeError, TypeError, ValueError, OverflowError):
        p.logit_bias = {-1: 0.0}                        # refused just below
    if not all(-100 <= b <= 100 and 0 <= t < vocab_size for t, b in p.logit_bias.items()):
        raise ValueError("logit_bias must map token ids to numbers in [-100, 100]")

class LogprobsFrontEnd(FrontEnd):
    def process(self, outputs: list) -> tuple[list, list]:
        """Part one's, and the log-probs of each token, and of a first token's prompt. Those of
        tokens a stop string cut (StopStringFrontEnd, which runs inside this) are cut too."""
        asked = []                   # the states given log-probs (most outputs carry none)
        for out in outputs:
            if out.finish_reason != "error" and (out.logprobs or out.prompt_logprobs) and \
                    (state := self.states.get(out.request_id)) is not None:
                state.prompt_logprobs = state.prompt_logprobs or out.prompt_logprobs
                state.logprobs += [out.logprobs] if out.logprobs else []
                asked.append(state)
        states, stopped = super().process(outputs)
        for state in asked:
            del state.logprobs[len(state.token_ids):]
        return states, stopped

    def validate(self, prompt_ids: list, params: SamplingParams):
        """Part one's checks, then this chapter's. max_tokens 0 asks for the prompt's log-probs
        alone (echo): it is checked as 1, the token sampled then dropped (LogprobsEngineCore)."""
        scores_only = params.max_tokens == 0 and params.prompt_logprobs is not None
        if scores_only:
            params.max_tokens = 1
        try:
            super().validate(prompt_ids, params)
        finally:
            if scores_only:
                params.max_tokens = 0
        check_logit_params(params, self.cfg.vocab_size)

class LogprobsRequestState(RequestState):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.logprobs: list = []          # (logprob, {token_id: logprob}) per token, if asked
        self.prompt_logprobs = None       # the same per prompt token, if asked

    def take_delta(self) -> Delta:
        """Part one's Delta with its tokens' log-probs, and on the first, the prompt's."""
        n, first = self.num_sent_tokens, self.num_sent_chars == self.num_sent_tokens == 0
        d = super().take_delta()
        return LogprobsDelta(d.index, d.text, d.token_ids, d.finish_reason, self.logprobs[n:],
                             self.prompt_logprobs if first else None)

@dataclass
class LogprobsDelta(Delta):
    logprobs: list                    # the new tokens' (logprob, {token_id: logprob}), if asked
    prompt_logprobs: Optional[list]   # on the first one, if asked

@dataclass
class LogprobsOutput(EngineCoreOutput):
    logprobs: Optional[tuple] = None  # (logprob, {token_id: logprob}), if asked
    prompt_logprobs: Optional[list] = None  # with the first token, if asked

class LogprobsSequence(Sequence):
    def __init__(self, *args):
        super().__init__(*args)
        self.prompt_logprobs: list = []   # (logprob, {token_id: logprob}) per prompt token so far

class LogprobsRunner(ModelRunner):
    def head(self, batch: ScheduledBatch, inputs: StepInputs, hidden) -> LaunchedStep:
        compute_prompt_logprobs(self, batch, hidden)      # the common case: none asked, no sync
        return super().head(batch, inputs, hidden)

    def draw(self, logits, step: LaunchedStep) -> torch.Tensor:
        """Part one's draw from the logits with each row's bias and penalties applied, in fp32
        (a new tensor: the log-probs read the model's own); the logits as they are if no row has
        any."""
        edits = logit_edits(step.seqs, self.device)
        if edits is not None:
            logits = pa.apply_logit_edits(logits.float(), edits)
        return super().draw(logits, step)

    def sample(self, step: LaunchedStep):
        """Part one's sample, then the log-probs of the rows' tokens if any row asks: they go into
        step.host after the tokens, the row's (chosen, top values, top ids)."""
        super().sample(step)
        k = max((s.params.logprobs for s in step.seqs if s.params.logprobs is not None),
                default=None)
        if k is not None and step.tokens is not None:
            self.copy_to_host(step, *sampled_logprobs(step.logits, step.tokens, k))

def sampled_logprobs(logits, tokens, k: int) -> tuple:   # (B, V), (B,)
    """The sampled tokens' log-probs (B,) and the top k values and ids (B, k), from the model's
    own logits, before edits, temperature and top-p."""
    logp = logits.float().log_softmax(dim=-1)              # (B, V) fp32
    top = logp.topk(k, dim=-1)                             # (B, k) values and indices
    return logp.gather(1, tokens.unsqueeze(1)).squeeze(1), top.values, top.indices

def logit_edits(seqs: list, device) -> Optional[tuple]:
    """pa.apply_logit_edits' entries (pa.logit_edit_entries) for the rows with a bias or a
    penalty, from every token so far; None if no row has any."""
    rows = [(row, seq.token_ids, seq.num_prompt_tokens, seq.params)
            for row, seq in enumerate(seqs)
            if seq.params.logit_bias or seq.params.needs_output_history]
    return pa.logit_edit_entries(rows, device) if rows else None

def compute_prompt_logprobs(runner: ModelRunner, batch: ScheduledBatch, hidden):  # (N_tok, D)
    """Append to each sequence that asks the entries of the prompt tokens it predicts."""
    if all(s.params.prompt_logprobs is None for s in batch.seqs):
        return                      # the common case: no LM head, no host sync
    C = runner.cfg.max_num_seqs       # rows per LM-head call: the sampler's memory budget
    for seq, rows in zip(batch.seqs, hidden.split(batch.num_new_tokens)):   # (n, D) each
        k, start = seq.params.prompt_logprobs, seq.num_computed_tokens
        a = max(start, len(seq.prompt_logprobs))       # a preempted sequence recomputes
        b = min(start + len(rows), seq.num_prompt_tokens - 1)  # row i predicts token i + 1
        if k is None or a >= b:
            continue
        targets = pa.to_device(runner.device, seq.token_ids[a + 1:b + 1], torch.int64)  # (T,)
        for h, t in zip(rows[a - start:b - start].split(C), targets.split(C)):
            logp = runner.model.compute_logits(h).float().log_softmax(dim=-1)  # (C, V)
            top, chosen = logp.topk(k, dim=-1), logp.gather(1, t[:, None])[:, 0]
            seq.prompt_logprobs += [(lp, dict(zip(i, v))) for lp, i, v in zip(
                chosen.tolist(), top.indices.tolist(), top.values.tolist())]

class LogprobsEngineCore(EngineCore):
    def _append_token(self, seq: Sequence, token: int, *logprobs) -> EngineCoreOutput:
        """Part one's, and into its output the token's log-prob and seq's top k, if it asked
        (logprobs: the token's row, (chosen, top values, top ids), if the step computed any);
        with its first token, its prompt's log-probs."""
        out = super()._append_token(seq, token)
        if seq.params.max_tokens == 0:        # the prompt only scored: its token is dropped
            out.token_id = None
        if seq.params.prompt_logprobs is not None and seq.num_output_tokens == 1:
            out.prompt_logprobs = seq.prompt_logprobs
        k = seq.params.logprobs
        if out.token_id is not None and logprobs and k is not None:
            chosen, top_values, top_ids = logprobs
            out.logprobs = (chosen, dict(zip(top_ids[:k], top_values[:k])))
        return out

# -- the server's half: the fields read, and log-probs in each endpoint's shape --
def num_top_logprobs(f: dict) -> Optional[int]:
    """The top log-probs a request asks per token (None: no log-probs): completions' "logprobs": k,
    or chat's "logprobs": true with "top_logprobs": k."""
    if "messages" in f:
        return f.get("top_logprobs", 0) if f.get("logprobs") else None
    return f.get("logprobs")

class LogprobsServer(OpenAIServer):
    """The handlers with log-probs, logit_bias and the penalties, and completions' echo."""
    async def sampling_params(self, f: dict, max_tokens: int) -> list:
        # echo with max_tokens 0 scores the prompt: one token is still sampled, which the engine
        # core drops
        k, edits = num_top_logprobs(f), {name: f[name] for name in _LOGIT_EDIT_FIELDS if name in f}
        return [dataclasses.replace(p, logprobs=k, prompt_logprobs=k if f.get("echo") else None,
                                    **edits) for p in await super().sampling_params(f, max_tokens)]

    def completion_shape(self, f: dict, prompts: list, prompt_ids: list, n: int) -> _Shape:
        return LogprobsCompletionShape(self, f, prompts, prompt_ids, n)

    def chat_shape(self, f: dict, num_prompt_tokens: int) -> _Shape:
        return LogprobsChatShape(self, f, num_prompt_tokens)

_LOGIT_EDIT_FIELDS = ("logit_bias", "presence_penalty", "frequency_penalty", "repetition_penalty")

class _HeldTextLogprobs:
    """A shape's chunks, where a token whose text is held back still sends its log-probs."""
    num_top_logprobs = property(lambda self: num_top_logprobs(self.f))

    def delta_chunks(self, state: RequestState, d: Delta) -> list:
        chunks = super().delta_chunks(state, d)
        if not d.text and d.token_ids and self.num_top_logprobs is not None:
            chunks.insert(0, self.choice(d) | {"finish_reason": None})
        return chunks

class LogprobsCompletionShape(_HeldTextLogprobs, _CompletionShape):
    """The completions shape with log-probs and echo. `echo` puts each prompt before its choices'
    text and, with `logprobs`, its tokens' log-probs before theirs (null for the first, which
    nothing predicts). An echo not sent yet goes with the last chunk."""
    def __init__(self, server, f: dict, prompts: list, prompt_ids: list, n: int):
        super().__init__(server, f, sum(map(len, prompt_ids)))
        self.echoes = [(p if isinstance(p, str) else server.front.decode(ids), ids)
                       if f.get("echo") else None
                       for p, ids in zip(prompts, prompt_ids)]   # (text, ids) or None
        self.n, self.offsets = n, {}          # choice -> text_offset of its next token

    def choice(self, d: Delta) -> dict:
        echo = self.echoes[d.index // self.n] if d.index not in self.offsets else None
        self.offsets.setdefault(d.index, 0)
        return {"index": d.index, "text": echo[0] + d.text if echo else d.text,
                "logprobs": completion_logprobs(self, d, echo), "finish_reason": d.finish_reason}

class LogprobsChatShape(_HeldTextLogprobs, _ChatShape):
    def choice(self, d: Delta) -> dict:
        return super().choice(d) | {"logprobs": chat_logprobs(self, d)}

# -- log-probs in each endpoint's shape (JSON has no -inf: clamped to -9999) --
def token_text(server: OpenAIServer, token: int) -> str:
    tokenizer = server.front.tokenizer
    return tokenizer.decode([token], skip_special_tokens=False) if tokenizer else str(token)

def token_logprobs(shape: _Shape, token_ids: list, logprobs: list):
    """Per token: (text, logprob, [(text, logprob) of the top alternatives])."""
    for token, (logprob, top) in zip(token_ids, logprobs):
        top = list(top.items())[:shape.num_top_logprobs]     # sorted, likeliest first
        yield (token_text(shape.server, token), max(logprob, -9999.0),
               [(token_text(shape.server, t), max(lp, -9999.0)) for t, lp in top])

def completion_logprobs(shape: _CompletionShape, d: Delta, echo) -> Optional[dict]:
    """The legacy shape: parallel lists, and each token's text_offset in the choice's text. With
    echo, the prompt's tokens come first (null for the first, which nothing predicts)."""
    if shape.num_top_logprobs is None:
        return None
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    rows = []                                          # (text, logprob, top) per token
    if echo:                              # the prompt's rows, the first one empty
        first = (token_text(shape.server, echo[1][0]), None, None)
        rows = [first, *token_logprobs(shape, echo[1][1:], d.prompt_logprobs or [])]
    for i, (text, logprob, top) in enumerate(
            rows + list(token_logprobs(shape, d.token_ids, d.logprobs))):
        if echo and i == len(rows):       # the completion starts after the echoed text
            shape.offsets[d.index] = len(echo[0])
        offset = shape.offsets[d.index]
        shape.offsets[d.index] = offset + len(text)
        for key, value in zip(out, (text, logprob, top if top is None else dict(top), offset)):
            out[key].append(value)
    return out

def chat_logprobs(shape: _ChatShape, d: Delta) -> Optional[dict]:
    """The chat shape: a list of {token, logprob, bytes, top_logprobs}."""
    if shape.num_top_logprobs is None or not d.token_ids:
        return None
    def entry(text, logprob):
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}
    return {"content": [{**entry(text, logprob), "top_logprobs": [entry(*t) for t in top]}
                        for text, logprob, top in token_logprobs(shape, d.token_ids, d.logprobs)]}

# ---------------------------------------------------------------------------
# Chapter: structured output (grammars and tool calls)
# A request may ask that its output match a JSON schema (response_format) or call a tool (tools
# with tool_choice). Either becomes an llguidance grammar, compiled once per source in the front
# end. In the engine core each such request gets its own matcher, which knows what the grammar
# allows next. Each step the host fills one bitmask row per constrained row (GrammarMasks, on a
# thread of its own while the next step is prepared), and the sampler sets what the mask forbids
# to -inf (pa.apply_token_mask). So a step with grammar rows samples later than part one's:
# GrammarRunner.sample only starts the fill, and finish_sample samples once the masks are there:
# when the step is read back, or when the next step takes its tokens as inputs. After the read
# back, each matcher follows its row's token.
# Tool calls: each model family writes a call its own way (TOOL_CALL_FORMATS). The server turns
# tools and tool_choice into a grammar of the whole answer, and parses the text back into call
# deltas as it grows (split_tool_calls, _ToolCallShape).
# Extends: FrontEnd (read_tool_calls, the grammar cache, check_grammar), OpenAIServer
# (sampling_params: the grammar; chat_text: tools as text; chat_shape: _ToolCallShape), Sequence
# (its matcher), ModelRunner (sample, finish_sample and draw; _put_input_ids samples the step
# before), EngineCore (add_request starts the matcher, _read_back follows, _finish_reason ends at
# the grammar's end). A seam: fail_running (rewind).

# How each model family writes a tool call, for tool_choice "auto": {"name": ..., KEY: {...}}
# between an opening and a closing; and llguidance's Lark grammar of a whole answer, SCHEMA
# standing for the calls' JSON schema: free text until the trigger (the opening's tag, which a
# lazy lexeme ends at once; for Llama, "{" first), strict from there. Llama's <|python_tag|>
# (a special token, which the decoder drops) opens its built-in tools: left out. Mistral v0.3's
# tokenizer makes [TOOL_CALLS] a special token too. That one is kept (read_tool_calls): the front
# end's tokenizer shows its text, and the grammar names the token by its id.
TOOL_CALL_FORMATS = {   # name: (opening, closing, the arguments' key, the answer's grammar)
    "hermes": ("<tool_call>\n", "\n</tool_call>", "arguments", r"""   # Qwen2.5, SmolLM3, Hermes
start: TEXT | head call (SEP call)* "\n"?
TEXT: /(.|\n)*/
head[lazy]: TEXT "<tool_call>"
call: "\n" SCHEMA "\n</tool_call>"
SEP: "\n<tool_call>" """),
    "llama3": ("", "", "parameters", r"""                               # Llama 3.1 and 3.2
start: TEXT | call (SEP call)*
TEXT: /(\s*[^{\s](.|\n)*)?/
call: SCHEMA
SEP: "; " """),
    "mistral": ("[TOOL_CALLS] [", "]", "arguments", r"""   # Mistral v0.3: a JSON list of calls
start: TEXT | head call (SEP call)* "]"
TEXT: /(.|\n)*/
head[lazy]: TEXT "[TOOL_CALLS] ["
call: SCHEMA
SEP: ", " """),
    "json": ("", "", "arguments", "start: call\ncall: SCHEMA"),    # a forced call: its JSON alone
}

def _tools_as_text(messages: list, tools: Optional[list], fmt: str) -> list:
    """For a template that renders neither tools nor calls: the tools in the system message,
    and earlier calls in the assistant's text, written the way the model is asked to."""
    opening, closing, key, _ = TOOL_CALL_FORMATS[fmt]
    def call(name: str, arguments: str) -> str:
        return f'{opening}{{"name": {name}, "{key}": {arguments}}}{closing}'
    out = [{**m, "content": m["content"] + "".join(call(json.dumps(c["function"]["name"]),
           json.dumps(c["function"]["arguments"])) for c in m.get("tool_calls") or [])}
           for m in messages]
    if tools:
        system = out.pop(0)["content"] + "\n\n" if out[0]["role"] == "system" else ""
        out.insert(0, {"role": "system", "content": system + "You can call these functions:\n"
                       + "\n".join(map(json.dumps, tools)) + "\nTo call one, answer "
                       + call("<function name>", "<arguments as a JSON object>")})
    return out

def tool_call_format(cfg: Config, template: str) -> str:
    """How the model writes a call for tool_choice "auto": the flag's format, else Mistral's if the
    chat template writes [TOOL_CALLS], else Llama's if it writes <|python_tag|> or "parameters"
    and no <tool_call>, else Hermes's (also what _tools_as_text asks for)."""
    if cfg.tool_call_parser != "auto":
        return cfg.tool_call_parser
    if "[TOOL_CALLS]" in template:
        return "mistral"
    llama = "<|python_tag|>" in template or '"parameters"' in template
    return "llama3" if llama and "<tool_call>" not in template else "hermes"

def read_tool_calls(front: FrontEnd) -> tuple:
    """How the model writes its calls: the format (tool_call_format), and the id of the token
    that opens a call where the tokenizer makes it special, else None. Mistral v0.3's
    [TOOL_CALLS] is such a token. The decoder would drop it, and llguidance never matches a
    special token to text. So the front end's tokenizer is rebuilt with it as an ordinary added
    token, as Qwen's <tool_call> is. Every answer then shows its text. Encoding stays the same,
    and the grammar names the token by its id (tool_call_grammar)."""
    fmt = tool_call_format(front.cfg, front.chat_template.source)
    spec = json.loads(front.tokenizer.to_str()) if fmt == "mistral" and front.tokenizer else {}
    token = next((t for t in spec.get("added_tokens", [])
                  if t["content"] == "[TOOL_CALLS]" and t["special"]), None)
    if token is None:
        return fmt, None
    token["special"] = False
    front.tokenizer = type(front.tokenizer).from_str(json.dumps(spec))
    return fmt, token["id"]

MAX_SCHEMA_DEPTH = 128    # JSON nesting that llguidance reads (serde_json's limit)
# How prepare_schema reads a keyword's value: a map of names to schemas, or branches that
# combine with the schema around them. Any other keyword's value is a schema, or holds some.
_SCHEMA_KEYWORDS = {"properties": "names", "$defs": "names", "definitions": "names",
                    "allOf": "branch", "anyOf": "branch", "not": "branch",
                    "const": "value", "enum": "value", "default": "value", "examples": "value"}

def prepare_schema(schema, strict: bool = False):
    """A copy of a JSON schema for the grammar. An object that lists properties and does not say
    additionalProperties gets none, as in vLLM's default backend (xgrammar's strict mode). A
    branch of allOf, anyOf or not is left open: closed, it would refuse the keys that the other
    branches or the schema around it allow, and could match nothing. An integer without bounds
    gets JSON's exact range, so its digits end. With strict, OpenAI's two rules for objects hold,
    or a ValueError names the one broken (llguidance names keywords). A schema nested deeper than
    llguidance reads is a ValueError too, before Python's own recursion limit is reached."""
    def walk(node, path: str, depth: int, kind: str = "schema"):
        if depth > MAX_SCHEMA_DEPTH:
            raise ValueError(f"is nested more than {MAX_SCHEMA_DEPTH} levels deep ({path[:40]}...)")
        if kind == "value" or not isinstance(node, (dict, list)):
            return node
        if isinstance(node, list):
            return [walk(v, f"{path}/{i}", depth + 1, kind) for i, v in enumerate(node)]
        if kind == "names":                   # each name's schema
            return {k: walk(v, f"{path}/{k}", depth + 1) for k, v in node.items()}
        out = {k: walk(v, f"{path}/{k}", depth + 1, _SCHEMA_KEYWORDS.get(k, "schema"))
               for k, v in node.items()}
        if isinstance(out.get("properties"), dict):
            if strict and out.get("additionalProperties") is not False:
                raise ValueError(f"is strict: an object needs additionalProperties false ({path})")
            if strict and set(out["properties"]) - set(out.get("required", [])):
                raise ValueError(f"is strict: every property must be in required ({path})")
            if kind != "branch":
                out.setdefault("additionalProperties", False)
        if out.get("type") == "integer":   # its own bounds win (an exclusive one holds beside)
            out = {"minimum": -2**53 + 1, "maximum": 2**53 - 1} | out
        return out
    return walk(schema, "#", 0)

def tool_call_grammar(fmt: str, tools: list, choice: str, parallel: bool,
                      opening_token: Optional[int] = None) -> str:
    """An answer's grammar in format fmt: calls {"name", key} of any tool ("auto", "required")
    or the one named, spaced as json.dumps (as models are trained), one unless parallel. Tool
    i's parameters sit at anyOf[i].properties[key]: their $refs ("#/$defs/X") are moved there.
    With opening_token (read_tool_calls), Mistral's opening is that special token, written
    <[id]> in llguidance's Lark, then " [". Text cannot hold it, so TEXT ends there by itself,
    with no lazy lexeme (which could not hold a special token either)."""
    key, lark = TOOL_CALL_FORMATS[fmt][2:]
    if opening_token is not None and fmt == "mistral":
        lark = lark.replace('head[lazy]: TEXT "[TOOL_CALLS] ["',
                            f'head: TEXT <[{opening_token}]> " ["')
    tools = [t["function"] for t in tools if choice in ("auto", "required", t["function"]["name"])]
    params = [json.loads(json.dumps(prepare_schema(t.get("parameters", {"type": "object"})))
              .replace('"$ref": "#', f'"$ref": "#/anyOf/{i}/properties/{key}'))
              for i, t in enumerate(tools)]
    schema = {"x-guidance": {"whitespace_flexible": False, "key_separator": ": ",
                             "item_separator": ", "}, "anyOf": [
        {"type": "object", "required": ["name", key], "additionalProperties": False,
         "properties": {"name": {"const": t["name"]}, key: p}} for t, p in zip(tools, params)]}
    lark = lark if parallel else lark.replace(" (SEP call)*", "")
    return "%llguidance {}\n" + lark.replace("SCHEMA", "%json " + json.dumps(schema))

def split_tool_calls(fmt: tuple, text: str, final: bool) -> tuple[str, list]:
    """The content (text before the first call, less a tail that may yet open one or end in
    whitespace, unless final) and calls ([name, arguments as JSON text so far]) of an answer so
    far. Monotone: more text parses to this and more, so a stream sends only what is new."""
    opening, closing, key = fmt[:3]       # a TOOL_CALL_FORMATS entry
    trigger = opening.rstrip()
    start = text.find(trigger) if trigger else \
        len(text) - len(text.lstrip()) if text.lstrip()[:1] in "{" else -1   # "": not yet known
    if start == -1:
        held = next((k for k in range(len(trigger) - 1, 0, -1) if text.endswith(trigger[:k])), 0)
        return (text if final else text[:len(text) - held].rstrip()), []
    # Between two calls: a closing and an opening (Hermes), "; " (Llama) or ", " (Mistral)
    head = re.compile(rf'\s*(?:{re.escape(trigger)}|[;,])?\s*\{{\s*"name"\s*:\s*'
                      rf'("(?:[^"\\]|\\.)*")\s*,\s*"{key}"\s*:\s*')
    calls, pos = [], start
    while m := head.match(text, pos):
        try:                          # the arguments end where their JSON value does
            end = m.end() + json.JSONDecoder().raw_decode(text[m.end():])[1]
        except ValueError:            # still being written, or cut short
            return text[:start].rstrip(), calls + [[json.loads(m[1]), text[m.end():]]]
        calls.append([json.loads(m[1]), text[m.end():end]])
        if not (after := re.compile(rf"\s*\}}(?:\s*{re.escape(closing)})?").match(text, end)):
            break
        pos = after.end()
    return text[:start].rstrip(), calls

def compile_grammar(front: FrontEnd, source: str, lark: bool = False) -> str:
    """llguidance's grammar for a JSON schema (as JSON, through prepare_schema; compact output)
    or Lark text, checked: a ValueError says why not. FrontEnd.grammar caches it, one per source."""
    if front.tokenizer is None:
        raise ValueError(f"structured output needs {front.cfg.model}/tokenizer.json")
    num_tokens = front.tokenizer.get_vocab_size()     # llguidance's matcher refuses more
    if num_tokens > front.cfg.vocab_size:
        raise ValueError(f"structured output needs the tokenizer's {num_tokens} tokens within "
                         f"the model's vocab_size ({front.cfg.vocab_size})")
    grammar = llguidance.LLMatcher.grammar_from_lark(source) if lark else \
        llguidance.LLMatcher.grammar_from_json_schema(json.dumps(prepare_schema(
            json.loads(source))), overrides={"whitespace_flexible": False})
    if error := _grammar_error(grammar):
        raise ValueError(f"the schema cannot be compiled: {error}")
    return grammar

async def request_grammar(server: OpenAIServer, source, field: str = "response_format"):
    """The grammar of a JSON schema or of Lark text, compiled in a thread (FrontEnd.grammar); None
    without a source ({} is one: any JSON value). A bad one is a 400 that names the field."""
    try:
        lark = isinstance(source, str)
        return None if source is None else await asyncio.to_thread(
            server.front.grammar, source if lark else json.dumps(source), lark)
    except ValueError as e:
        raise APIError(400, f"'{field}': {e}", param=field)

def call_format(front: FrontEnd, f: dict) -> Optional[str]:
    """The format a chat request's calls are written in: None (no calls), the model's own for
    tool_choice "auto", or "json" for a forced call ("required", or a tool's name)."""
    tool = f.get("tool_choice")
    return None if not tool else front.tool_call_format if tool == "auto" else "json"

class GrammarServer(OpenAIServer):
    """The handlers with grammars: response_format's JSON schema, or the grammar of the whole
    answer that tools and tool_choice make (a call wins over response_format). Tools the template
    does not render go into the messages as text (_tools_as_text)."""
    async def sampling_params(self, f: dict, max_tokens: int) -> list:
        params = await super().sampling_params(f, max_tokens)
        if fmt := call_format(self.front, f):
            lark = tool_call_grammar(fmt, f["tools"], f["tool_choice"],
                                     f.get("parallel_tool_calls", True), self.front.tool_call_token)
            grammar = await request_grammar(self, lark, "tools")
        else:
            grammar = await request_grammar(self, f.get("response_format"))
        return [dataclasses.replace(p, grammar=grammar) for p in params]

    def chat_text(self, f: dict) -> str:
        messages, tools = f["messages"], f.get("tools")
        if "tool" not in self.front.chat_template.source:
            messages, tools = _tools_as_text(messages, tools, self.front.tool_call_format), None
        return self.front.chat_template.render(messages, tools=tools)

    def chat_shape(self, f: dict, num_prompt_tokens: int) -> _Shape:
        if (fmt := call_format(self.front, f)) is None:
            return super().chat_shape(f, num_prompt_tokens)
        shape = _ToolCallShape(self, f, num_prompt_tokens, TOOL_CALL_FORMATS[fmt])
        shape.hold = fmt == "json" and bool(f["stop"])   # a stop string may cut a forced call
        shape.family = self.front.tool_call_format     # a forced call's ids too: json is no family
        return shape

def tool_call_id(family: str) -> str:
    """A new call's id, in a form the family's chat template takes back with the call's result.
    Mistral's template raises unless an id is 9 letters or digits (vLLM makes them so). The
    others take any string, and get OpenAI's form: call_ and 24 hex digits."""
    return uuid.uuid4().hex[:9] if family == "mistral" else f"call_{uuid.uuid4().hex[:24]}"

class _ToolCallShape(LogprobsChatShape):
    """The chat shape with tools: the text is parsed (split_tool_calls) into content and call
    deltas (index, id, type, name, arguments), and the last chunk's finish_reason is "tool_calls"
    if the model called. A forced call that a stop string may cut is held to its end (hold): it
    comes whole, or if cut, as text with "stop"."""
    family = "hermes"         # how the model writes calls (FrontEnd.tool_call_format): tool_call_id
    hold = False

    def __init__(self, server, f: dict, num_prompt_tokens: int, call_format: tuple):
        super().__init__(server, f, num_prompt_tokens)
        self.call_format = call_format    # a TOOL_CALL_FORMATS entry
        self.sent = {}        # choice -> [its text, content chars sent, [argument chars sent]]

    def opening(self, i: int) -> list:
        """The role's chunk, its content null until there is text."""
        return [{**c, "delta": {**c["delta"], "content": None}} for c in super().opening(i)]

    async def chunks(self, states, n: int):
        """A held call's chunks come from its last state alone: all of its text, at the end."""
        async with contextlib.aclosing(super().chunks(
                _last_states(states) if self.hold else states, n)) as chunks:
            async for choice in chunks:
                yield choice

    def delta_chunks(self, state: RequestState, d: Delta) -> list:
        """Those with something to say: text held back inside a call parses to no delta."""
        return [c for c in super().delta_chunks(state, d) if c["delta"] != {} or c["logprobs"]
                or c["finish_reason"] is not None]

    def parsed_delta(self, d: Delta, final: bool) -> dict:
        """What is new in choice d.index's content and calls, from its whole text parsed again."""
        text, num_chars, num_args = self.sent.setdefault(d.index, ["", 0, []])
        text = self.sent[d.index][0] = text + d.text
        content, calls = split_tool_calls(self.call_format, text, final)
        delta = {"content": content[num_chars:]} if len(content) > num_chars else {}
        self.sent[d.index][1] = len(content)
        new = []
        for i, (name, arguments) in enumerate(calls):
            if i >= len(num_args):                 # a call's first delta names it
                new.append({"index": i, "id": tool_call_id(self.family), "type": "function",
                            "function": {"name": name, "arguments": arguments}})
            elif len(arguments) > num_args[i]:
                new.append({"index": i, "function": {"arguments": arguments[num_args[i]:]}})
        num_args[:] = [len(arguments) for _, arguments in calls]
        return delta | ({"tool_calls": new} if new else {})

    def last(self, state: RequestState, d: Delta) -> dict:
        delta = self.parsed_delta(dataclasses.replace(d, text=""), final=True)
        called = d.finish_reason == "stop" and self.sent[d.index][2]
        return {"index": d.index, "delta": delta, "logprobs": None,
                "finish_reason": "tool_calls" if called else d.finish_reason}

    def choice(self, d: Delta) -> dict:
        delta = self.parsed_delta(d, False)
        try:            # a held call comes whole: if a stop string cut it, it is text, not a call
            if self.hold and d.finish_reason == "stop":
                json.loads(d.text)
        except ValueError:
            delta, self.sent[d.index] = {"content": d.text}, ["", 0, []]   # last: no call
        return {"index": d.index, "delta": delta,
                "logprobs": chat_logprobs(self, d), "finish_reason": d.finish_reason}

    def fold(self, whole: dict, chunk: dict):
        """Part one's, but each tool-call delta joins its call by index (a new index opens the
        next call), as a stream's client joins them."""
        delta = dict(chunk["delta"])
        for item in delta.pop("tool_calls", []):
            calls = whole.setdefault("delta", {}).setdefault("tool_calls", [])
            if item["index"] == len(calls):       # a new call (they come in order)
                calls.append({})
            _fold(calls[item["index"]], item)
        super().fold(whole, chunk | {"delta": delta})

    async def body(self, chunks) -> dict:
        """The whole response, each call in OpenAI's non-streamed shape: without the `index`
        that joins a stream's deltas to their call (fold)."""
        body = await super().body(chunks)
        for choice in body["choices"]:
            for call in choice["message"].get("tool_calls", []):
                del call["index"]
        return body

async def _last_states(states):
    """Of a request's states, only the finished ones."""
    async with contextlib.aclosing(states):
        async for state in states:
            if state.finish_reason is not None:
                yield state

# -- the engine core's half: matchers, masks, and the tokens followed --
class GrammarMasks:
    """The host half: each request's matcher, its masks filled on every core but one (the step
    loop keeps its own; 16 at most), the sampled tokens followed. Copies of one matcher share
    its lexer, so their masks would fill one at a time. So requests are dealt round families,
    one per fill thread: request n's matcher copies its grammar's matcher built for family
    n % num_threads (built once per family, on first use). One pinned bitmask buffer, sized for
    a full step, is reused every step: the engine reads a step back (a sync past its bitmask
    copy) before it fills the next one. The buffer (16 MB at 1,024 seats and a 128k vocabulary)
    and the threads are made when a grammar first comes: an engine that serves none pays for
    neither."""

    def __init__(self, tokenizer_path, eos_token_ids, max_rows, vocab_size, pin):
        import llguidance.numpy                       # the bitmask fill (fill_async)
        self.num_threads = min(16, max(1, (os.cpu_count() or 2) - 1))
        self.executor = functools.cache(lambda: llguidance.LLExecutor(self.num_threads))
        self.tokenizer = functools.cache(lambda: llguidance.LLTokenizer(   # built on first use
            tokenizer_path, n_vocab=vocab_size, eos_token=eos_token_ids))
        self.built = functools.lru_cache(maxsize=64 * self.num_threads)(   # the 64 latest grammars
            lambda grammar, family: llguidance.LLMatcher(self.tokenizer(), grammar))
        self.num_matchers = 0
        self.followed = []    # (seq, its length with the token) of the rows followed last (follow)
        self.bitmask = functools.cache(lambda: torch.empty(   # (max_rows, cdiv(V, 32))
            max_rows, -(-vocab_size // 32), dtype=torch.int32, pin_memory=pin))
        self.thread = ThreadPoolExecutor(1)   # waits on the pool for fill_async
        self.compiler = ThreadPoolExecutor(1)  # builds matchers, off the loop

    def start_matcher(self, grammar):
        """A Future of new_matcher(grammar), built on the compile thread, never on the step loop;
        None without a grammar. Ready long before its first sample, mostly. Sequence.matcher holds
        it until the row's first fill, which waits for it once and keeps the matcher instead."""
        return None if grammar is None else self.compiler.submit(self.new_matcher, grammar)

    def new_matcher(self, grammar):
        """A request's own matcher: a copy of its grammar's, built once per grammar and family."""
        family, self.num_matchers = self.num_matchers % self.num_threads, self.num_matchers + 1
        return self.built(grammar, family).deep_copy()

    def start_fill(self, seqs, device):
        """For GrammarRunner.sample: fill_async for the rows with a grammar; None if there is none
        (part one's Sequence, as the memory profile's, has no matcher)."""
        rows = [row for row, seq in enumerate(seqs) if getattr(seq, "matcher", None) is not None]
        for seq in (seqs[row] for row in rows if isinstance(seqs[row].matcher, Future)):
            seq.matcher = seq.matcher.result()   # a Future's result() takes a lock each call
        return self.fill_async([seqs[row].matcher for row in rows], rows, device) if rows else None

    def fill_async(self, matchers, rows, device):
        """A Future of apply_token_mask's arguments, (rows, bitmask) on the device. On a thread of
        its own, what each matcher allows next fills a (R, cdiv(V, 32)) int32 row of the pinned
        buffer (llguidance drops the GIL and splits the rows over its threads). Then both copies
        are queued (the default stream: the sampler's, after)."""
        def fill_and_copy():
            bitmask = self.bitmask()[:len(matchers)]
            llguidance.numpy.fill_next_token_bitmask_par(
                self.executor(), [(m, i) for i, m in enumerate(matchers)], bitmask.numpy())
            bitmask = bitmask.to(device, non_blocking=True)
            return pa.to_device(bitmask.device, rows, torch.int64), bitmask
        return self.thread.submit(fill_and_copy)

    def follow(self, seqs, tokens):
        """For GrammarEngineCore._read_back: each unfinished grammar row's matcher takes its
        read-back token, so that the grammar follows the output. It runs before _commit's row loop
        appends the tokens, since _finish_reason asks the matcher whether the token ended the
        grammar. So `followed` keeps each row's length once its token is appended, for rewind."""
        rows = [(seq, token) for seq, token in zip(seqs, tokens)
                if seq.matcher is not None and not seq.is_finished]
        self.followed = [(seq, seq.num_tokens + 1) for seq, _ in rows]
        self.consume([(seq.matcher, token) for seq, token in rows])

    def rewind(self):
        """After a fault in _commit's row loop (fail_running): a row that the fault kept from its
        token, and that lives on (a waiting one, preempted by the step launched after), takes its
        matcher back by that token. Else it would resume one token ahead of its text."""
        for seq, num_tokens in self.followed:
            if not seq.is_finished and seq.num_tokens < num_tokens:
                seq.matcher.rollback(1)
        self.followed = []

    def consume(self, pairs):
        """Each (matcher, sampled token) pair's matcher takes its token, in parallel (a rejected
        one leaves its matcher in the error state, as consume_token does)."""
        if pairs:
            self.executor().consume_token_par(pairs)

def check_grammar(grammar):
    """A grammar llguidance cannot read is a ValueError before its request is queued. Its matcher
    would otherwise end the request at once with no text, or fail the whole step. The server's
    come from compile_grammar, checked there already through the same cache."""
    if grammar is not None and not isinstance(grammar, str):
        raise ValueError("grammar must be a string, llguidance's (FrontEnd.grammar makes one)")
    if error := grammar is not None and _grammar_error(grammar):
        raise ValueError(f"grammar is not valid: {error.strip()}")

_grammar_error = functools.lru_cache(maxsize=256)(llguidance.LLMatcher.validate_grammar)

@dataclass
class GrammarParams(SamplingParams):
    grammar: Optional[str] = None     # an llguidance grammar the output must follow

class GrammarFrontEnd(FrontEnd):
    """The front end that knows how the model writes a tool call (read_tool_calls), compiles
    grammars (grammar: compile_grammar, cached one per source), and checks a request's."""
    def __init__(self, cfg: Config, num_blocks: int):
        super().__init__(cfg, num_blocks)
        self.tool_call_format, self.tool_call_token = read_tool_calls(self)
        self.grammar = functools.lru_cache(maxsize=256)(functools.partial(compile_grammar, self))

    def validate(self, prompt_ids: list, params: SamplingParams):
        super().validate(prompt_ids, params)
        check_grammar(params.grammar)

class GrammarSequence(Sequence):
    matcher = None     # its grammar's matcher (a Future of it until its first fill); None: none

class GrammarRunner(AsyncRunner):
    """The sampler with grammar masks. A step with grammar rows samples in finish_sample, once
    their masks are filled: at its read back (GrammarEngineCore), or earlier, when the next step
    takes its tokens as inputs on the device (_put_input_ids). One step fills at a time, since
    each step is sampled before the next one's fill starts."""
    filling = None     # (step, the Future of its masks) while its grammar rows wait for them

    def __init__(self, cfg: Config):
        self.grammar_masks = GrammarMasks(     # before part one's: its memory profile samples
            str(Path(cfg.model) / "tokenizer.json"), cfg.eos_token_ids, cfg.max_num_seqs,
            cfg.vocab_size, torch.device(cfg.device).type == "cuda")
        super().__init__(cfg)

    def sample(self, step: LaunchedStep):
        masks = self.grammar_masks.start_fill(step.seqs, self.device)
        if masks is None:
            return super().sample(step)
        self.filling = (step, masks)           # sampled in finish_sample

    def finish_sample(self, step: Optional[LaunchedStep]):
        if self.filling is not None and self.filling[0] is step:
            super().sample(step)               # draw() masks its rows
            self.filling = None

    def draw(self, logits, step: LaunchedStep) -> torch.Tensor:
        """Part one's draw on a copy of the logits, in fp32, that the grammar rows' masks set
        to -inf where their grammar forbids a token (the log-probs read the model's own)."""
        if self.filling is None or self.filling[0] is not step:
            return super().draw(logits, step)
        rows, bitmask = self.filling[1].result()
        masked = pa.apply_token_mask(logits.to(torch.float32, copy=True), rows, bitmask)
        return super().draw(masked, step)

    def _put_input_ids(self, batch: ScheduledBatch, input_ids: list):
        if self.prev is not None:              # its tokens are some of this step's inputs
            self.finish_sample(self.prev)
        super()._put_input_ids(batch, input_ids)

class GrammarEngineCore(EngineCore):
    def add_request(self, request: EngineCoreRequest):
        super().add_request(request)
        seq = self.seqs[request.request_id]    # a Future: built off the step loop
        seq.matcher = self.runner.grammar_masks.start_matcher(request.params.grammar)

    def _read_back(self, step: LaunchedStep):
        """Sample the step if its grammar rows waited for masks, then read it back; each grammar
        row's matcher follows its token."""
        self.runner.finish_sample(step)
        rows = list(super()._read_back(step))
        self.runner.grammar_masks.follow(step.seqs, [row[0] for _, row in rows])
        return rows

    def _finish_reason(self, seq: Sequence, token: int) -> Optional[str]:
        """Part one's, and "stop" when seq's grammar has ended: its answer is whole."""
        if seq.matcher is not None and seq.matcher.is_stopped():
            return "stop"
        return super()._finish_reason(seq, token)

# ---------------------------------------------------------------------------
# Chapter: tensor parallelism
# With tensor_parallel_size N the model is cut over N GPUs (gloo processes on the CPU), in
# Megatron-LM's way. Column-parallel matmuls (q, k, v; gate, up) keep a rank's n_heads/N query
# heads, n_kv/N KV heads and I/N channels, so attention and SiLU-and-mul need no other rank: a
# rank's model is part one's Model of a config with those sizes (build_shard). Row-parallel ones
# (o, down) leave a partial (N_tok, D) sum on each rank. An all-reduce adds the partial sums up,
# twice a layer, at the end of each Attention and MLP (sum_over_ranks, a forward hook). Rank 0's
# part alone brings the residual, so the sum counts it once. The embedding, norms and LM head
# stay whole, so every rank holds the same residual stream. A rank's KV pool holds its n_kv/N
# heads, in the same blocks. pa.shard cuts each checkpoint tensor (a q, k or v bias as its
# weight's rows) as the loader reads it.
# The engine core is rank 0, and start_workers runs ranks 1..N-1, each a process of its own.
# Rank 0 alone schedules, computes logits and samples. The last all-reduce gives every rank the
# same hidden states, and sampling reads host state (generators, grammars, tokens) that only
# rank 0 keeps. Each step, rank 0 pipes every worker put_step's arguments (a few host lists). The
# input ids follow by a device broadcast, since a pending token is on rank 0's GPU only.
# Start-up (loading, the pool's size, CUDA graphs with their all-reduces) runs alike on every
# rank.
# Extends: ModelRunner (__init__ starts the workers; load_model builds the rank's shard;
# num_kv_blocks takes the least over the ranks; put_step sends the workers each step's plan;
# close stops them). The faults and engine core process chapters call stop_out_of_step
# (fail_running), exit_on_worker_death and exit_on_failed_step (run_engine_core).

class TensorParallelRunner(ModelRunner):
    """Rank 0's runner, with the workers started first and stopped if its start-up fails
    (start_up); then each step's plan goes to them (put_step). A worker builds the same class,
    and follows rank 0's steps (_follow_steps)."""
    def __init__(self, cfg: Config):
        self.workers = start_workers(cfg, type(self))     # None: one rank, or a worker
        with start_up(self.workers):
            super().__init__(cfg)

    def load_model(self) -> Model:
        return build_shard(self.cfg)

    def num_kv_blocks(self) -> int:
        """The least of every rank's count (each rank's pool, sized from its own memory)."""
        return pa.min_over_ranks(super().num_kv_blocks(), self.device)

    def put_step(self, flat: dict, N: int, S: int, width: int, is_decode: bool) -> tuple:
        send_step(self.workers, (flat, N, S, width, is_decode))   # put_step's arguments
        inputs = super().put_step(flat, N, S, width, is_decode)
        pa.broadcast_from_rank0(inputs[0])      # the input ids: a pending one is on rank 0 only
        return inputs

    def close(self):
        stop_workers(self.workers)
        super().close()

def build_shard(cfg: Config) -> Model:
    """This rank's shard of the model: part one's Model of the rank's heads and channels, loaded
    with each checkpoint tensor's cut (pa.shard), whose Attention and MLP sum over the ranks."""
    tp, shard_cfg = cfg.tensor_parallel_size, copy.copy(cfg)
    shard_cfg.num_heads, shard_cfg.num_kv_heads, shard_cfg.intermediate_size = (
        cfg.num_heads // tp, cfg.num_kv_heads // tp, cfg.intermediate_size // tp)
    model = build_model(shard_cfg, ((key, pa.shard(t, key, tp)) for key, t in read_checkpoint(cfg)))
    if tp > 1:
        for layer in model.layers:
            for module in (layer.attn, layer.mlp):
                module.register_forward_pre_hook(residual_on_rank0, with_kwargs=True)
                module.register_forward_hook(sum_over_ranks)
    return model

def residual_on_rank0(module, args, kwargs):
    """Before a row-parallel layer (Attention, MLP): the residual joins rank 0's partial sum
    alone, so the sum over ranks counts it once (at batch 1 still added in the kernel that
    reads the weight)."""
    if dist.get_rank() > 0:
        kwargs["residual"] = None
    return args, kwargs

def sum_over_ranks(module, args, out):                        # (N_tok, D), in place
    """After it: every rank's partial (N_tok, D) summed, so each holds the whole. In a CUDA
    graph the all-reduce is captured like any kernel (NCCL supports stream capture), on every
    rank in the same graph sizes."""
    dist.all_reduce(out)
    return out

def start_workers(cfg, make_runner):
    """On rank 0 with cfg.tensor_parallel_size > 1: start ranks 1..N-1, each a process that
    builds make_runner(cfg) (ModelRunner) and follows rank 0's steps (_follow_steps), and join
    them in one process group. Returns their TensorParallelWorkers; None at size 1, or on a
    worker (in the group already). One engine per process uses the group (_close_workers)."""
    n = cfg.tensor_parallel_size     # n_heads is a multiple of n_kv, so divides too
    g = math.gcd(cfg.num_kv_heads, cfg.intermediate_size)   # the sizes that fit divide g
    if n < 1 or g % n:
        raise ValueError(f"tensor_parallel_size {n} must divide the model's {cfg.num_heads} "
                         f"query heads, {cfg.num_kv_heads} KV heads and MLP size "
                         f"{cfg.intermediate_size}: this model runs on "
                         f"{', '.join(str(k) for k in range(1, g + 1) if g % k == 0)}")
    if dist.is_initialized() and dist.get_rank() > 0:
        return None
    if dist.is_initialized():
        raise ValueError("a tensor-parallel engine is still open in this process (close it "
                         "first: LLM.close()), or ran on GPUs here, where its NCCL group "
                         "outlives it (start the next engine in a new process)")
    if n > 1 and getattr(multiprocessing.current_process(), "_inheriting", False):
        sys.exit(f"error: tensor_parallel_size {n} from a script needs the script's LLM(...) "
                 "under `if __name__ == \"__main__\":`, since each worker imports the script")
    return TensorParallelWorkers(cfg, make_runner) if n > 1 else None

@contextlib.contextmanager
def start_up(workers):
    """Around rank 0's start-up, which every rank runs alike. If it raises (a bad setting that
    every rank meets, Ctrl-C), the workers stop before the error goes on: a caller who catches it
    keeps a clean process. Once it is done, rank 0 sends its steps (send_step)."""
    try:
        yield
    except BaseException:
        stop_workers(workers)
        raise
    if workers is not None:
        workers.started = True

def stop_workers(workers, why: str = ""):
    """TensorParallelWorkers.close, where there are workers (LLM.close). A later step raises
    `why`, by default that the engine is closed (send)."""
    if workers is not None:
        workers.why_closed = why or workers.CLOSED
        workers.close()

def stop_out_of_step(workers, error: BaseException):
    """After a step that raised on rank 0 (fail_running), Ctrl-C too: the workers may be inside
    it still, in all-reduces rank 0 will never join, so the ranks are out of step for good. The
    workers stop now. The next step then raises at once and says why (send), where it would
    wait in a collective for gloo's 30 minutes. Behind a server, the engine core process then
    ends (exit_on_failed_step)."""
    if workers is not None and not workers.closed.is_set():
        stop_workers(workers, f"this tensor-parallel engine stopped at a step that failed "
                              f"({error!r}): its ranks were out of step. Start a new one")

def exit_on_worker_death(workers):
    """Where rank 0 is a process of its own behind a server (the engine core): a worker's death
    ends it, as its own would (TensorParallelWorkers)."""
    if workers is not None:
        workers.exit_on_death = True

def exit_on_failed_step(workers, sender):
    """In the engine core process, after a step that raised on rank 0: the workers have stopped
    (stop_out_of_step), so no step can run. The process ends as at a worker's death, once
    `sender` has sent the step's outputs: the tokens it read back, then the failed requests'
    errors. A request that the step finished keeps its end; the server fails the rest. It exits
    at once (os._exit): a normal exit would tear down the process group of the workers just
    stopped, which can wait on them."""
    if workers is not None and workers.closed.is_set():
        sender.shutdown(wait=True)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)

def send_step(workers, plan):
    """Rank 0's step plan to every worker, once start-up is done (start_up)."""
    if workers is not None and workers.started:
        workers.send(plan)

def _backend(device):
    return "nccl" if str(device).startswith("cuda") else "gloo"

def _init_group(device, rank, size, port, store=None):
    device_id = torch.device("cuda", rank) if _backend(device) == "nccl" else None
    if store is None:
        store = dist.TCPStore("127.0.0.1", port, size, is_master=rank == 0)
        store.add("joined", 1)         # rank 0 waits for every other rank (TensorParallelWorkers)
    dist.init_process_group(_backend(device), store=store, rank=rank, world_size=size,
                            device_id=device_id)

class TensorParallelWorkers:
    """Rank 0's end of the other ranks: a pipe to each (send), a watchdog on their lives, close.

    Each worker is a spawned process (CUDA cannot be forked) that ends when its pipe from rank 0
    reads EOF: rank 0 gone, however it went (closed, killed), so no worker outlives it. A worker
    that dies is seen at once by the watchdog thread, which waits on the processes' sentinels.
    Rank 0 then exits too (exit_on_death) in three cases. In the engine core process
    (exit_on_worker_death), whose server then fails the requests as for any engine-core death.
    On the GPU, where a collective waiting for a dead rank never returns. And during start-up,
    which may be waiting for the dead rank to join the group. Else (LLM on the CPU) the step in
    flight raises instead (gloo reports the peer gone), and so does every later send.

    close (_close_workers) runs once: at LLM.close, when the workers are collected with their
    LLM, when start-up fails (start_up), and at exit, before multiprocessing waits for its
    children. Neither it nor the watchdog holds self, so an LLM dropped without close is still
    collected, and closed."""

    CLOSED = "this tensor-parallel engine is closed (LLM.close())"

    def __init__(self, cfg, make_runner):
        n, backend = cfg.tensor_parallel_size, _backend(cfg.device)
        if backend == "nccl" and torch.cuda.device_count() < n:
            raise ValueError(f"tensor_parallel_size {n} needs {n} GPUs, "
                             f"found {torch.cuda.device_count()}")
        # The engine core process is a daemon (it ends with its server), and multiprocessing lets
        # no daemon start a process. Its workers end with it by their pipes' EOF, so the flag goes.
        multiprocessing.current_process().daemon = False
        # The group's rendezvous, on a free port. Held here, it outlives a start-up broken off
        # (Ctrl-C), so that the workers it leaves waiting there go quietly, by close.
        self.store = dist.TCPStore("127.0.0.1", 0, n, is_master=True, wait_for_workers=False)
        ctx = multiprocessing.get_context("spawn")
        self.pipes, self.procs, self.closed = [], [], threading.Event()
        self.error, self.started = "", False
        self.why_closed = self.CLOSED      # what send says once closed (stop_out_of_step)
        self.exit_on_death = backend == "nccl"
        self.close = multiprocessing.util.Finalize(
            self, _close_workers, (self.pipes, self.procs, self.closed), exitpriority=100)
        with sigint_held():            # Ctrl-C stops rank 0 alone, and the workers by close
            for rank in range(1, n):
                reader, writer = ctx.Pipe(duplex=False)
                proc = ctx.Process(target=_worker_main, name=f"nanoserve-tp-rank-{rank}",
                                   args=(make_runner, cfg, rank, self.store.port, reader),
                                   daemon=True)
                proc.start()
                reader.close()         # the worker's end, closed here: a dead worker's pipe breaks
                self.pipes.append(writer)
                self.procs.append(proc)
        threading.Thread(target=_watch, name="nanoserve-tp-watchdog", daemon=True, args=(
            weakref.ref(self), [p.sentinel for p in self.procs], self.closed)).start()
        while self.store.add("joined", 0) < n - 1:    # a wait in Python, which Ctrl-C can stop
            time.sleep(0.05)
        _init_group(cfg.device, 0, n, self.store.port, self.store)

    def send(self, plan):
        why = self.why_closed if self.closed.is_set() else self.error   # "": all ranks are well
        if why:
            raise RuntimeError(why)
        for pipe in self.pipes:
            pipe.send(plan)

def _close_workers(pipes, procs, closed):
    """Each worker reads EOF and exits. One still inside a step that rank 0 left (a failed step,
    Ctrl-C) waits in a collective for good, so it is killed after 1 s. Then a gloo group goes,
    so another engine may start. An NCCL group stays: destroying it is a collective that waits
    for every rank, and with the workers gone it would never return. So on GPUs the next
    engine needs a new process (start_workers)."""
    closed.set()                       # for the watchdog: from now on a death is no fault
    for pipe in pipes:
        pipe.close()
    deadline = time.monotonic() + 1
    for proc in procs:
        proc.join(max(0, deadline - time.monotonic()))
        if proc.is_alive():
            proc.kill()
            proc.join()
    if dist.is_initialized() and dist.get_backend() == "gloo":
        dist.destroy_process_group()

def _watch(ref, sentinels, closed):
    """The watchdog thread (TensorParallelWorkers), which holds the workers by a weak reference."""
    dead = multiprocessing.connection.wait(sentinels)
    workers = ref()
    if workers is None or closed.is_set():
        return
    proc = next(p for p in workers.procs if p.sentinel in dead)
    proc.join(1)
    workers.error = f"the tensor-parallel worker {proc.name} exited (exit code {proc.exitcode})"
    print(f"error: {workers.error}", file=sys.stderr, flush=True)
    if workers.exit_on_death or not workers.started:
        os._exit(1)

def _follow_steps(runner, pipe):
    """A worker's main loop, after the start-up every rank runs alike: each step rank 0 sends
    (put_step's arguments) through this rank's shard of the model, until the pipe closes. Its
    output is dropped: the all-reduces have given rank 0 the same hidden states."""
    with torch.no_grad():
        while True:
            try:
                plan = pipe.recv()
            except EOFError:              # rank 0 is gone, however it went
                return
            runner.forward(*runner.put_step(*plan))   # as rank 0: a graph's replay, or eager

def _worker_main(make_runner, cfg, rank, port, pipe):
    """A worker process: its signals, its GPU, its place in the group, then rank 0's start-up
    and steps. Once the pipe closes (rank 0 is gone), it is out at once: no teardown waits on a
    dead peer."""
    follow_parent()                # what stops rank 0 (the server, Ctrl-C) stops us by EOF
    if _backend(cfg.device) == "nccl":
        cfg.device = f"cuda:{rank}"
        torch.cuda.set_device(rank)
    try:
        _init_group(cfg.device, rank, cfg.tensor_parallel_size, port)
        runner = make_runner(cfg)
    except Exception:
        # A bad setting meets rank 0 too, which raises it to its caller and closes our pipe,
        # as it does when stopped during start-up (Ctrl-C): then the error is rank 0's to tell.
        if pipe.poll(5):
            os._exit(1)
        raise
    _follow_steps(runner, pipe)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)

# ---------------------------------------------------------------------------
# Chapter: fp8 weights
# With quantization="fp8", each decoder layer's matmul weights (qkv, o, gate_up, down) are
# quantized at load to fp8 e4m3, with one fp32 scale per output channel. A decode step then reads
# half the bytes it reads in bf16. The embedding, the norms and the LM head stay in the model's
# dtype (bf16 on a GPU, fp32 on the CPU). Under tensor parallelism each rank quantizes its own
# shard, after pa.shard, so a scale never spans ranks. pa.linear takes an fp8 weight as it is.
# At one row the GEMV widens each weight as it streams in. Up to 16 rows (and at one row of the
# largest weights) the skinny matmul quantizes x to e4m3, a scale per row for each 128 columns, and
# multiplies on the fp8 tensor cores. A larger batch quantizes x per token for them (linear_fp8).
# The kernels and their torch references are in paged_attention.py. On a CPU the reference widens
# the weights at every step, which is correct but slower than fp32.
# Extends: ModelRunner (__init__ checks the device, check_fp8; load_model quantizes the model it
# loaded, quantize_fp8_weights).

def check_fp8(cfg: Config):
    """fp8 on a GPU needs fp8 tensor cores (compute capability 8.9 or above: Ada, Hopper). On a
    CPU it runs, slowly, and one line on stderr says so at start-up."""
    if cfg.quantization and cfg.device.startswith("cuda") and \
            torch.cuda.get_device_capability(cfg.device) < (8, 9):
        raise ValueError("quantization fp8 needs fp8 tensor cores (compute capability 8.9 "
                         "or above: Ada, Hopper); run this GPU without it")
    if cfg.quantization and not cfg.device.startswith("cuda"):
        print("fp8 weights on the CPU run the torch reference (pa.linear_fp8_ref), which widens "
              "every weight at every step: several times slower than float32", file=sys.stderr)

def quantize_fp8_weights(model: Model, cfg: Config):
    """Each decoder layer's nn.Linear weight to e4m3, with its scales (pa.quantize_fp8)."""
    if cfg.quantization != "fp8":
        return
    for module in model.layers.modules():
        if isinstance(module, nn.Linear):
            module.weight = pa.quantize_fp8(module.weight)   # (N, K) e4m3, .scale (N,)

class Fp8WeightsRunner(ModelRunner):
    def __init__(self, cfg: Config):
        check_fp8(cfg)                                        # before anything loads
        super().__init__(cfg)

    def load_model(self) -> Model:
        model = super().load_model()             # under tensor parallelism, this rank's shard
        quantize_fp8_weights(model, self.cfg)
        return model

# ---------------------------------------------------------------------------
# Chapter: fp8 KV cache
# With kv_cache_dtype="fp8" the KV pool holds keys and values in fp8 e4m3, one byte each where
# bf16 takes two. The same memory then holds twice the tokens, and a decode step, which reads
# every cached K and V of its batch, reads half the bytes. The scale is 1.0, vLLM's default
# without calibration. rope_store clamps each value to +-448 and rounds it to e4m3, and the
# attention kernels widen it to q's dtype as they load it (paged_attention.py's store_kvcache
# section says why one fixed scale). q, the weights and the activations keep their dtype. The
# blocks, the block tables and the slots are as before, so CUDA graphs, prefix caching,
# preemption, drafts and tensor parallelism need nothing of their own. On the CPU the sdpa path
# widens what it reads from the pool, as the kernels do, so a lone sequence's K/V are copied
# where they were read in place. README.md's fp8 KV cache section has the quality it costs.
# Extends: ModelRunner (__init__ checks the device, check_fp8_kv_cache; kv_cache_dtype, which
# sizes and allocates the pool).

def check_fp8_kv_cache(cfg: Config):
    """Triton converts to and from e4m3 on compute capability 8.9 or above (Ada, Hopper)."""
    if cfg.kv_cache_dtype == "fp8" and cfg.device.startswith("cuda") and \
            torch.cuda.get_device_capability(cfg.device) < (8, 9):
        raise ValueError("kv_cache_dtype fp8 needs compute capability 8.9 or above (Ada, "
                         "Hopper); run this GPU with --kv-cache-dtype auto")

class Fp8KVCacheRunner(ModelRunner):
    def __init__(self, cfg: Config):
        check_fp8_kv_cache(cfg)                               # before anything loads
        super().__init__(cfg)

    @property
    def kv_cache_dtype(self) -> torch.dtype:
        """The KV pool's dtype: e4m3 with kv_cache_dtype="fp8", else part one's (the model's)."""
        return pa.FP8 if self.cfg.kv_cache_dtype == "fp8" else super().kv_cache_dtype

# ---------------------------------------------------------------------------
# Chapter: the rest of the OpenAI API
# Part one's handlers read a few fields, each checked for its JSON type. This chapter's server
# (APIServer) reads every field the other chapters answer: a table of each endpoint's fields, with
# their JSON types and rules (parse_fields). It adds the body's size limit and the API key, the
# routes /v1/models and /metrics, and errors in OpenAI's shape for whatever raises. An unknown
# field is refused, never ignored: it might have changed the output. A field the API defines but
# nanoserve does not implement is refused too, unless it asks for nothing new. So a client never
# gets other than it asked.
# A stream goes out at raw ASGI (_EventStream), which at a burst of streams costs the event loop
# less than Starlette's StreamingResponse.
# Extends: OpenAIServer (read_fields, routes, app, sampling_params: stop; stream_response),
# EngineCoreClient (MetricsClient: the latency histograms).

def _stop(v, f) -> list:
    v = [] if v is None else [v] if isinstance(v, str) else v
    if not (isinstance(v, list) and all(isinstance(s, str) and s for s in v)):
        raise ValueError("must be a non-empty string or a list of them")
    return v

def _prompt(v, f) -> list:
    """'prompt' as OpenAI takes it: a string, token ids, or a list of either;
    always a list of prompts here. FrontEnd.encode checks every id, once."""
    def one(p):
        return isinstance(p, str) or (isinstance(p, list) and bool(p) and isinstance(p[0], int))
    if not (one(v) or isinstance(v, list) and v and all(one(p) for p in v)):
        raise ValueError("must be a string, a list of token ids, or a non-empty list of either")
    return [v] if one(v) else v

def _messages(v, f) -> list:
    """Message content: a string, text parts (joined; others refused), or null for the assistant."""
    if not (v and all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in v)):
        raise ValueError("must be a non-empty list of objects with a string 'role'")
    parsed = []
    for m in v:
        content = m.get("content")
        if isinstance(content, list):
            bad = [p.get("type") if isinstance(p, dict) else p for p in content if not (
                isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str))]
            if bad:
                raise ValueError(f"content parts of type {bad[0]!r} are not supported (text only)")
            content = "\n".join(p["text"] for p in content)
        if not (isinstance(content, str) or content is None and m["role"] == "assistant"):
            raise ValueError("content must be a string or a list of text parts "
                             "(null only for the assistant)")
        if m["role"] == "tool" and not isinstance(m.get("tool_call_id"), str):
            raise ValueError("a 'tool' message needs the 'tool_call_id' it answers")
        calls = [_call_with_object(c) for c in m.get("tool_calls") or []]
        parsed.append({**m, "content": content or ""} | ({"tool_calls": calls} if calls else {}))
    return parsed

def _call_with_object(call) -> dict:
    """An earlier call as templates want it (`arguments | tojson`): OpenAI sends JSON text,
    kept as it is where it does not parse (a call that max_tokens cut short)."""
    function = call.get("function") if isinstance(call, dict) else None
    if not (isinstance(function, dict) and isinstance(function.get("name"), str)):
        raise ValueError("tool_calls must be [{'function': {'name', 'arguments'}}]")
    arguments = function.get("arguments") or "{}"
    with contextlib.suppress(TypeError, ValueError):     # TypeError: an object already
        arguments = json.loads(arguments)
    return {**call, "function": {**function, "arguments": arguments}}

def _rule(ok, why: str):
    """A 400 saying why unless ok(value, fields)."""
    def rule(v, f):
        if not ok(v, f):
            raise ValueError(why)
        return v
    return rule

_REQUIRED = _rule(lambda v, f: v is not None, "is required")

def _schema(v, f) -> Optional[dict]:
    """A schema, checked by prepare_schema: a 400 names what it breaks, its depth or, where the
    "strict" beside it asks, a rule of strict mode."""
    if v is not None:
        prepare_schema(v, f.get("strict") is True)
    return v

def _response_format(v, f) -> Optional[dict]:
    """The JSON schema that response_format asks the output to match, if any."""
    kind = (v or {}).get("type", "text")
    if not (kind in ("text", "json_object") or kind == "json_schema" and "json_schema" in v):
        raise ValueError("must be of type 'text', 'json_object' or 'json_schema' (and then have "
                         "'json_schema')")
    return None if kind == "text" else v.get("json_schema", {}).get("schema", {"type": "object"})

def _tool_choice(v, f) -> Optional[str]:
    """None (no call), "auto" (the model decides: the default with tools), "required" (a call of
    any tool) or the name of the one tool to call."""
    names = [t["function"]["name"] for t in f.get("tools") or []]
    if isinstance(v, dict):
        v = parse_fields(v, _FUNCTION_CHOICE, "tool_choice.")["function"]["name"]
        if v not in names:
            raise ValueError(f"names no function of 'tools' ({', '.join(names)})")
        return v
    if v not in (None, "none", "auto", "required") or v == "required" and not names:
        raise ValueError("must be 'none', 'auto', or with 'tools' 'required' or a named function")
    return None if v == "none" or not names else v or "auto"

_COMMON_FIELDS = dict(   # name: JSON type, or (JSON type, rule); {...}: an object, [..]: an array
    model=str, max_tokens=int, seed=int, stop=(object, _stop), temperature=float,
    n=(int, _rule(lambda v, f: v is None or 1 <= v <= 128, "must be in [1, 128] (OpenAI's)")),
    top_p=float, top_k=int, logit_bias=dict, presence_penalty=float, frequency_penalty=float,
    repetition_penalty=float, ignore_eos=bool, stream=bool,
    stream_options={"include_usage": bool, "include_obfuscation": bool},
    response_format=({"type": str, "json_schema": {"name": str, "description": str,
                                                   "schema": (dict, _schema), "strict": bool}},
                     _response_format),
    user=str, metadata=dict, store=bool, service_tier=str)   # the last four change nothing
COMPLETION_FIELDS = dict(_COMMON_FIELDS, prompt=(object, _prompt), echo=bool, logprobs=int,
    best_of=(int, _rule(lambda v, f: v in (None, f["n"] or 1), "other than 'n' is not supported")),
    suffix=(str, _rule(lambda v, f: not v, "(insertion) is not supported")))
CHAT_FIELDS = dict(_COMMON_FIELDS, messages=(list, _messages), logprobs=bool, top_logprobs=int,
    max_completion_tokens=int, parallel_tool_calls=bool,
    tools=[{"type": str, "function": ({"name": (str, _rule(lambda v, f: re.fullmatch(
        r"[a-zA-Z0-9_-]{1,64}", v or ""), "must be 1-64 of a-z, A-Z, 0-9, _ and - (OpenAI's)")),
        "description": str, "parameters": (dict, _schema), "strict": bool}, _REQUIRED)}],
    tool_choice=(object, _tool_choice))    # after tools: its rule reads them
_FUNCTION_CHOICE = {"type": str, "function": ({"name": (str, _REQUIRED)}, _REQUIRED)}
_JSON_TYPES = {int: "an integer", float: "a number", bool: "a boolean", str: "a string",
               dict: "an object", list: "an array"}

def parse_fields(body: dict, spec: dict, path: str = "") -> dict:
    """The body's fields, checked against spec (a JSON null is absent; an unknown field is a 400).
    A nested object is checked against its own spec; a 400 names the path (tools[0].type)."""
    fields = {}
    for name, value in body.items():
        if name not in spec:
            raise APIError(400, f"'{path}{name}' is not supported by this server",
                           param=path + name)
        kind = spec[name][0] if isinstance(spec[name], tuple) else spec[name]
        fields[name] = _check(value, kind, path + name)
    for name, rule in [(k, v[1]) for k, v in spec.items() if isinstance(v, tuple)]:
        try:                          # every rule runs, present or not (defaults)
            fields[name] = rule(fields.get(name), fields)
        except ValueError as e:
            raise APIError(400, f"'{path}{name}' {e}", param=path + name)
    return {k: v for k, v in fields.items() if v is not None}

def _check(value, kind, path: str):
    """A value against its kind: a JSON type, an object's spec or [an array's item kind]."""
    if kind is object or value is None and not path.endswith("]"):   # null: an absent field,
        return value                                                  # but never an array item
    shape = dict if isinstance(kind, dict) else list if isinstance(kind, list) else kind
    # an integer is a fine number; true is an int in Python but not in JSON
    accepted = (int, float) if shape is float else shape
    if not isinstance(value, accepted) or isinstance(value, bool) != (shape is bool):
        raise APIError(400, f"'{path}' must be {_JSON_TYPES[shape]}, "
                            f"got {json.dumps(value)[:40]}", param=path)
    if isinstance(kind, dict):
        return parse_fields(value, kind, path + ".")
    if isinstance(kind, list):
        return [_check(item, kind[0], f"{path}[{i}]") for i, item in enumerate(value)]
    if kind is int and not -2**63 <= value < 2**64:
        raise APIError(400, f"'{path}' is out of the 64-bit range", param=path)
    if kind is float and not abs(value) <= sys.float_info.max:   # 1e400 parsed to inf, 10**400
        raise APIError(400, f"'{path}' must be a finite number", param=path)
    return float(value) if kind is float else value

# -- the body, the API key, the routes beyond completions, and errors --
def _reject_constant(name: str):       # NaN and Infinity: Python's extension, not JSON
    raise ValueError(f"{name} is not a JSON value")

async def read_body(server: OpenAIServer, request: Request) -> dict:
    """The JSON body, refused as soon as it is too large (before it is read whole), and refused if
    it names another model."""
    data, limit = bytearray(), server.cfg.max_request_bytes
    try:
        async for chunk in request.stream():
            data += chunk
            if len(data) > limit:
                raise APIError(413, f"the body is larger than {limit} bytes")
    except ClientDisconnect:              # the client left mid-body: nobody to answer
        raise APIError(499, "the client closed the connection")
    try:
        body = json.loads(data, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as e:   # bad JSON, bad UTF-8, too deep
        raise APIError(400, f"the body is not valid JSON: {str(e)[:200]}")
    if not isinstance(body, dict):
        raise APIError(400, "the body must be a JSON object")
    model = body.get("model")
    if model is not None and model != server.model_name:
        raise APIError(404, f"the model {str(model)[:100]!r} does not exist; this server "
                            f"serves {server.model_name!r}", param="model",
                       code="model_not_found")
    return body

def keyed(server: OpenAIServer, handler):
    """handler behind the API key, where one is set (cfg.api_key)."""
    async def checked(request: Request):
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        # the scheme is case-insensitive (RFC 9110); compare_digest's timing hides the key
        if server.cfg.api_key and not (scheme.lower() == "bearer" and hmac.compare_digest(
                given.strip().encode(), server.cfg.api_key.encode())):
            raise APIError(401, "missing or wrong API key: send 'Authorization: Bearer KEY'",
                           code="invalid_api_key")
        return await handler(request)
    return checked

def api_routes(server: OpenAIServer) -> list:
    """/v1/models, behind the key, and /metrics, open so that scrapers need no key."""
    created = int(time.time())

    async def models(request: Request) -> Response:
        card = {"id": server.model_name, "object": "model", "created": created,
                "owned_by": "nanoserve", "max_model_len": server.cfg.max_model_len}
        wanted = request.path_params.get("model", server.model_name)
        if wanted != server.model_name:
            raise APIError(404, f"the model {wanted!r} does not exist", param="model",
                           code="model_not_found")
        return JSONResponse(card if "model" in request.path_params else
                            {"object": "list", "data": [card]})

    async def metrics(request: Request) -> Response:
        return Response(prometheus_client.generate_latest(server.client.metrics.registry),
                        media_type=prometheus_client.CONTENT_TYPE_LATEST)
    return [Route("/metrics", metrics), Route("/v1/models", keyed(server, models)),
            Route("/v1/models/{model:path}", keyed(server, models))]

class APIServer(OpenAIServer):
    fields = {"completions": COMPLETION_FIELDS, "chat": CHAT_FIELDS}

    async def read_fields(self, request: Request, endpoint: str) -> dict:
        return parse_fields(await read_body(self, request), self.fields[endpoint])

    def routes(self) -> list:
        """Part one's routes, each under /v1/ behind the API key (keyed), and /v1/models and
        /metrics (api_routes)."""
        return [Route(r.path, keyed(self, r.endpoint), methods=r.methods)
                if r.path.startswith("/v1/") else r for r in super().routes()] + api_routes(self)

    def app(self) -> Starlette:
        app = super().app()
        for kind in (APIError, HTTPException, Exception):
            app.add_exception_handler(kind, error_response)
        return app

    async def sampling_params(self, f: dict, max_tokens: int) -> list:
        return [dataclasses.replace(p, stop=f["stop"])
                for p in await super().sampling_params(f, max_tokens)]

    def stream_response(self, events) -> Response:
        return _EventStream(events)

class _EventStream:
    """A stream's response at raw ASGI, for speed: each event goes out in one `send` as it comes.
    Starlette's StreamingResponse runs the writing in a task group of its own (under uvicorn's
    ASGI spec 2.3); at a burst of 400 streams this served about 6% more tokens a second than it,
    in one GPU lease (README's Speed section). Here a task of its own listens for the client
    leaving, then cancels the writing, whose CancelledError closes the events: their `finally`
    (the abort) runs at once."""
    headers = [(b"content-type", b"text/event-stream; charset=utf-8"),
               (b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]  # nginx: unbuffered

    def __init__(self, events):
        self.events = events              # _Shape.stream: SSE text, event by event

    async def __call__(self, scope, receive, send):
        async def listen():
            while (await receive())["type"] != "http.disconnect":
                pass
            writer.cancel()
        writer, listener = asyncio.current_task(), asyncio.create_task(listen())
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.headers})
            async with contextlib.aclosing(self.events) as events:
                async for event in events:
                    await send({"type": "http.response.body", "body": event.encode(),
                                "more_body": True})
            await send({"type": "http.response.body", "body": b""})
        except asyncio.CancelledError:   # the client left (listen's cancel), or the server stops
            if listener.cancelled() or not listener.done():
                raise
            writer.uncancel()             # the client's leaving is this response's normal end
        finally:
            listener.cancel()

async def error_response(request: Request, e: Exception) -> Response:
    """Every error in OpenAI's shape: ours, Starlette's (unknown path, wrong method) and crashes
    (logged; the client gets one line). A 413 or 5xx closes the connection: a pool opens another."""
    if isinstance(e, HTTPException):   # an unknown path: say which are (chapter: the Responses API)
        e = APIError(e.status_code, e.detail if e.status_code != 404 else f"{request.url.path} is "
                     "not served: try /v1/chat/completions, /v1/completions or /v1/responses")
    elif not isinstance(e, APIError):
        e = APIError(500, f"internal error: {type(e).__name__}", "internal_error")
    headers = {"Connection": "close"} if e.status == 413 or e.status >= 500 else None
    return JSONResponse(e.body, status_code=e.status, headers=headers)

# -- /metrics --
class MetricsClient(EngineCoreClient):
    """The client that times each request's tokens as they reach the server (ServerMetrics)."""
    def __init__(self, cfg: Config, **kw):
        super().__init__(cfg, **kw)
        self.metrics = ServerMetrics(self)

    def _deliver(self, outputs: list) -> list:
        now = time.perf_counter()                          # one clock reading for the whole batch
        states = super()._deliver(outputs)
        for state in states:
            self.metrics.observe(state, now)
        return states

    def _abort(self, request_ids: list):
        """An aborted request gets no last state to observe: its clock goes here."""
        for request_id in request_ids:
            self.metrics.clocks.pop(request_id, None)
        super()._abort(request_ids)

class ServerMetrics:
    """Prometheus' view: latency histograms observed in the server process, and the engine core's
    gauges and counters from its latest stats (EngineCore.stats), read at each scrape."""
    def __init__(self, client: EngineCoreClient):
        self.client = client
        self.clocks = {}     # request id -> (when its last token came, its tokens timed so far)
        self.registry = prometheus_client.CollectorRegistry()
        self.registry.register(self)
        self.ttft = prometheus_client.Histogram(
            "nanoserve_time_to_first_token_seconds", "time from arrival to first token",
            buckets=[0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30], registry=self.registry)
        self.itl = prometheus_client.Histogram(
            "nanoserve_inter_token_latency_seconds", "gap between tokens, 0 within a chunk",
            buckets=[0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 10], registry=self.registry)

    def observe(self, state: RequestState, now: float):
        """Time to first token, then a gap per token (0 within a chunk, as the client sees it)."""
        last, num_timed = self.clocks.get(state.request_id, (None, 0))
        if num_new := len(state.token_ids) - num_timed:
            if last is None:
                self.ttft.observe(now - state.arrival_time)
            else:
                self.itl.observe(now - last)
            for _ in range(num_new - 1):
                self.itl.observe(0.0)
            self.clocks[state.request_id] = now, len(state.token_ids)
        if state.finish_reason is not None:
            self.clocks.pop(state.request_id, None)

    def collect(self):
        """At a scrape: the engine core's gauges and counters, from its latest stats."""
        for name, value in self.client.stats.items():   # prometheus_client adds "_total" back
            family = CounterMetricFamily if name.endswith("_total") else GaugeMetricFamily
            yield family(f"nanoserve_{name.removesuffix('_total')}", name, value=value)

# ---------------------------------------------------------------------------
# Chapter: the Responses API
# /v1/responses is what OpenAI's SDK (client.responses) and its Agents SDK call by default. A
# Responses request is a chat request in other words, so this chapter adds no engine mechanism.
# Its handler checks the body by its own table, writes the chat body it stands for (chat_body),
# and hands that to the chat handler. So the chat template, sampling, grammars and tool calls
# run as for chat. The chat shape's chunks are re-shaped (_ResponsesShape) into Responses events,
# or into one response object. nanoserve keeps no state: previous_response_id is a 400, and
# store is accepted but stores nothing.
# Extends: OpenAIServer (routes: /v1/responses; chat_shape: the re-shaping).

_STRING = (str, _REQUIRED)                    # a string that the item needs
_ITEMS = {   # each type of input item's fields, beside type, id and status (which change nothing)
    "message": dict(content=(object, _REQUIRED), role=(str, _rule(lambda v, f: v in (
        "user", "assistant", "system", "developer"), "must be 'user', 'assistant', 'system' or "
        "'developer'"))),
    "function_call": dict(call_id=_STRING, name=_STRING, arguments=_STRING),
    "function_call_output": dict(call_id=_STRING, output=_STRING)}
_TEXT_PART = dict(type=(str, _rule(lambda v, f: v in ("input_text", "output_text"), "must be "
                  "'input_text' or 'output_text'")), text=_STRING, annotations=list, logprobs=list)

def _input(v, f) -> list:
    """'input' as chat messages. A string is a user message. A message item keeps its role (but
    developer is system), a function_call joins the assistant message before it as a tool call,
    and a function_call_output is a "tool" message."""
    items = [{"role": "user", "content": v}] if isinstance(v, str) else _check(v, [dict], "input")
    if not items:
        raise ValueError("must be a string or a non-empty list of items")
    messages = []
    for i, item in enumerate(items):
        if (kind := item.get("type", "message")) not in _ITEMS:
            raise ValueError(f"items of type {kind!r} are not supported ({', '.join(_ITEMS)})")
        item = parse_fields(item, dict(_ITEMS[kind], type=str, id=str, status=str), f"input[{i}].")
        if kind == "message":
            text = item["content"] if isinstance(item["content"], str) else [
                {"type": "text", "text": p["text"]}
                for p in _check(item["content"], [_TEXT_PART], f"input[{i}].content")]
            messages.append({"role": item["role"].replace("developer", "system"), "content": text})
        elif kind == "function_call_output":
            messages.append(dict(role="tool", tool_call_id=item["call_id"], content=item["output"]))
        else:
            if not messages or messages[-1]["role"] != "assistant":
                messages.append({"role": "assistant", "content": None})
            messages[-1].setdefault("tool_calls", []).append({"id": item["call_id"], "function": {
                "name": item["name"], "arguments": item["arguments"]}, "type": "function"})
    return messages

RESPONSES_FIELDS = dict(   # chat_body's body is checked by CHAT_FIELDS after these, as chat's is
    model=str, input=(object, _input), instructions=str, max_output_tokens=int,
    temperature=float, top_p=float, stream=bool, parallel_tool_calls=bool,
    tools=[{"type": (str, _rule(lambda v, f: v == "function", "must be 'function' (built-in tools "
                                "are not served)")), **CHAT_FIELDS["tools"][0]["function"][0]}],
    tool_choice=(object, _rule(lambda v, f: not isinstance(v, dict) or v.get("type") == "function"
                               and isinstance(v.get("name"), str) and len(v) == 2,
                               "must be a string or {'type': 'function', 'name': ...}")),
    text={"format": {"type": (str, _rule(lambda v, f: v in (None, "text", "json_object",
          "json_schema"), "must be 'text', 'json_object' or 'json_schema'")), "name": str,
          "description": str, "schema": (dict, _schema), "strict": bool}, "verbosity": str},
    include=(list, _rule(lambda v, f: not v, "is not supported: there is nothing to include")),
    previous_response_id=(str, _rule(lambda v, f: v is None, "is not supported: this server keeps "
                                     "no state, so send the whole conversation as 'input'")),
    user=str, metadata=dict, store=bool, service_tier=str,   # these change nothing, and nor
    reasoning=dict)          # do reasoning (no model here takes an effort) and verbosity

def chat_body(r: dict) -> dict:
    """The chat request that a Responses request (its checked fields) stands for."""
    fmt, choice = r.get("text", {}).get("format", {}), r.get("tool_choice")
    schema = {k: v for k, v in fmt.items() if k != "type"}   # name, description, schema, strict
    system = [{"role": "system", "content": r["instructions"]}] if "instructions" in r else []
    body = dict(
        messages=system + r["input"], max_completion_tokens=r.get("max_output_tokens"),
        temperature=r.get("temperature"), top_p=r.get("top_p"), stream=r.get("stream"),
        tools=[{"type": "function", "function": {k: v for k, v in t.items() if k != "type"}}
               for t in r.get("tools", [])] or None,
        tool_choice={"type": "function", "function": {"name": choice["name"]}}
        if isinstance(choice, dict) else choice, parallel_tool_calls=r.get("parallel_tool_calls"),
        response_format={"type": fmt.get("type", "text"), "json_schema": schema or None})
    return {k: v for k, v in body.items() if v is not None}

class ResponsesServer(OpenAIServer):
    def routes(self) -> list:
        return super().routes() + [Route("/v1/responses", self.responses, methods=["POST"])]

    async def responses(self, request: Request) -> Response:
        """POST /v1/responses: the chat request that this body stands for, answered by the chat
        handler (OpenAIServer.answer_chat), its chat shape re-shaped into Responses events."""
        r = parse_fields(await read_body(self, request), RESPONSES_FIELDS)
        f = parse_fields(chat_body(r), CHAT_FIELDS)
        return await self.answer_chat(request, f | {"responses": r})

    def chat_shape(self, f: dict, num_prompt_tokens: int):
        """A Responses request's chat shape (f["responses"]: its own fields), re-shaped."""
        shape = super().chat_shape(f, num_prompt_tokens)
        return _ResponsesShape(shape, f["responses"]) if "responses" in f else shape

_ECHOED = dict(instructions=None, tools=[], tool_choice="auto", parallel_tool_calls=True,
               temperature=1.0, top_p=1.0, max_output_tokens=None, metadata={}, user=None,
               text={"format": {"type": "text"}})   # the settings a response echoes: defaults

class _ResponsesShape:
    """A chat shape's chunks as Responses events, which a stream sends and a body drops. Text grows
    a message item, and each call (a tool_calls delta with an id) a function_call item. An item
    is added, grows, and is done before the next is added, as OpenAI streams them."""
    def __init__(self, chat: _ChatShape, r: dict):
        self.chat, self.r, self.output, self.status, self.num_events = chat, r, [], "in_progress", 0
        self.id, self.created_at = "resp_" + uuid.uuid4().hex, int(time.time())
        self.chunks = chat.chunks                 # what stream or body re-shapes

    def response(self) -> dict:
        n, m, status = self.chat.num_prompt_tokens, self.chat.num_completion_tokens, self.status
        return {"id": self.id, "object": "response", "created_at": self.created_at, "error": None,
                "model": self.chat.server.model_name, "status": status, "store": False,
                "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete"
                else None, "output": self.output, "usage": None if status == "in_progress" else {
                    "input_tokens": n, "input_tokens_details": {"cached_tokens": 0},
                    "output_tokens": m, "output_tokens_details": {"reasoning_tokens": 0},
                    "total_tokens": n + m}, **{k: self.r.get(k, v) for k, v in _ECHOED.items()}}

    def event(self, type: str, of_last_item: bool = False, **fields) -> str:
        """An event, as JSON text at once: a snapshot of items that go on growing."""
        if of_last_item:
            fields |= {"item_id": self.output[-1]["id"], "output_index": len(self.output) - 1}
        self.num_events += 1
        return _to_json({"type": type, "sequence_number": self.num_events - 1, **fields})

    def add(self, item: dict) -> list:
        """The events that finish the item before, then add this one (in progress)."""
        events = self.done("completed") + [self.event(
            "response.output_item.added", output_index=len(self.output), item=item)]
        self.output.append(item)
        return events

    def done(self, status: str) -> list:
        """The events that finish the last item, if it is in progress."""
        if not self.output or (item := self.output[-1])["status"] != "in_progress":
            return []
        item["status"], part = status, (item.get("content") or [None])[0]   # a message's text
        events = [self.event("response.output_text.done", True, content_index=0, logprobs=[],
                             text=part["text"]),
                  self.event("response.content_part.done", True, content_index=0, part=part),
                  ] if part else [self.event("response.function_call_arguments.done", True,
                                             name=item["name"], arguments=item["arguments"])]
        return events + [self.event("response.output_item.done",
                                    output_index=len(self.output) - 1, item=item)]

    def events(self, choice: dict) -> list:
        """The events that one chat chunk stands for."""
        delta, events = choice["delta"], []
        if text := delta.get("content"):
            if not self.output or self.output[-1]["type"] != "message":
                events += self.add({"id": "msg_" + uuid.uuid4().hex, "type": "message",
                                    "role": "assistant", "status": "in_progress", "content": []})
                part = {"type": "output_text", "text": "", "annotations": []}
                self.output[-1]["content"].append(part)
                events.append(self.event("response.content_part.added", True, content_index=0,
                                         part=part))
            self.output[-1]["content"][0]["text"] += text
            events.append(self.event("response.output_text.delta", True, content_index=0,
                                     delta=text, logprobs=[]))
        for call in delta.get("tool_calls", []):
            if "id" in call:                      # a call's first delta names it
                events += self.add({"id": "fc_" + uuid.uuid4().hex, "type": "function_call",
                                    "status": "in_progress", "call_id": call["id"],
                                    "name": call["function"]["name"], "arguments": ""})
            if arguments := call["function"].get("arguments"):
                self.output[-1]["arguments"] += arguments
                events.append(self.event("response.function_call_arguments.delta", True,
                                         delta=arguments))
        if choice["finish_reason"] is not None:   # "length": cut short by max_output_tokens
            self.status = "incomplete" if choice["finish_reason"] == "length" else "completed"
            events += self.done(self.status)
        return events

    async def stream(self, chunks, include_usage: bool):
        """Created, in_progress, each chunk's events, then completed or incomplete (or error)."""
        for kind in ("created", "in_progress"):
            yield _sse(self.event(f"response.{kind}", response=self.response()))
        async with contextlib.aclosing(chunks):
            try:
                async for choice in chunks:
                    for event in self.events(choice):
                        yield _sse(event)
                yield _sse(self.event(f"response.{self.status}", response=self.response()))
            except APIError as e:             # a bug here ends the stream, logged by uvicorn
                yield _sse(self.event("error", **e.body))

    async def body(self, chunks) -> dict:
        """One response object."""
        async with contextlib.aclosing(chunks):
            async for choice in chunks:
                self.events(choice)
        return self.response()

# ---------------------------------------------------------------------------
# Chapter: faults
# A fault ends the requests it touches, with finish_reason "error", and nothing else. A step
# that raises fails the running requests (fail_running), and the engine core process goes on
# with the waiting ones. The outputs the step made before it raised still go out first
# (EngineCore.committed), so a request it finished keeps its end. LLM.run, however it stops,
# ends every request it has, waiting ones too (end_run). It may stop at an error or Ctrl-C
# anywhere in its loop, or when its caller closes it. An error in the caller's own loop (at
# generate's progress line) drops it, and CPython closes a dropped generator at once. An engine
# core process that dies fails every request in flight, and the server stays up to say so
# (engine_died).
# Ctrl-C sends SIGINT to every process of the terminal's group: the server or the LLM's process,
# the engine core, and the tensor-parallel workers alike. Only the parent acts on it. It stops its
# children by closing their pipes, which they read as EOF. Three helpers keep that true at every
# moment of start-up. A child is born with SIGINT blocked (sigint_held), so that one still
# importing torch prints no traceback. Its first step (follow_parent) ignores SIGINT and SIGTERM
# and watches its parent, so that a parent that dies first, however it went, ends it at once.
# While the engine core loads, it reads no pipe. So a server stopped then (child_stopped_on_error)
# closes the engine core's outbox instead, which the engine core watches too, and it ends at
# once with its workers.
# Extends: LLM.run (wrapped at the end of the file: ends_every_request, for part one's engine
# too). The engine core process chapter calls it in run_engine_core (fail_running,
# follow_parent), start_engine_core (child_stopped_on_error, sigint_held) and receive_outputs
# (engine_died); the tensor-parallel workers use sigint_held and follow_parent alike.

def fail_running(core: EngineCore, error: BaseException, waiting: bool = False) -> list:
    """A step raised, or LLM.run stopped (end_run). Every running sequence ends in error, and its
    blocks are freed. Waiting ones stay queued (unless `waiting`), none with a pending token,
    since the launched step is dropped unread. The outputs the step had made come first in the
    list, those of _commit's rows before a fault there too: a request they finish runs no more,
    so they are its last. (A step that returned has handed its outputs out already.) A waiting
    grammar row that the fault kept from its token takes its matcher back (GrammarMasks.rewind)."""
    core.launched = None
    stop_out_of_step(getattr(core.runner, "workers", None), error)   # (part one's runner: none)
    if masks := getattr(core.runner, "grammar_masks", None):   # (part one's runner: none)
        masks.rewind()
    failed = [s for s in core.seqs.values() if waiting or s.status == "running"]
    for seq in failed:
        core.abort_request(seq.request_id)
    for seq in core.seqs.values():
        seq.num_pending_tokens = 0
    return core.committed + [EngineCoreOutput(s.request_id, None, finish_reason="error",
                             error=f"the engine failed: {error!r}") for s in failed]

def ends_every_request(run):
    """LLM.run, wrapped: whatever stops it first (an error or Ctrl-C anywhere, the caller closing
    it) ends every request it has in error (end_run)."""
    @functools.wraps(run)
    def wrapped(llm: LLM):
        try:
            yield from run(llm)
        except BaseException as e:   # GeneratorExit too: closed, or dropped by the caller's error
            end_run(llm, e)
            raise
    return wrapped

def end_run(llm: LLM, error: BaseException):
    """LLM.run stopped before its requests ended. Every request ends in error, running or waiting
    (fail_running), so that the next call runs only its own. So does one that the engine core
    ended but whose output the front end had not read (Ctrl-C while it read)."""
    outputs = fail_running(llm.engine, error, waiting=True)
    unread = llm.front.states.keys() - {out.request_id for out in outputs}
    llm.front.process(outputs + [EngineCoreOutput(request_id, None, finish_reason="error",
                      error=f"the engine failed: {error!r}") for request_id in unread])

def engine_died(client: EngineCoreClient):
    """The engine core process is gone. Every request in flight ends with an error, and /health
    turns 503."""
    client.process.join(1)
    client.error = f"the engine core process exited (exit code {client.process.exitcode})"
    print(f"error: {client.error}; failing every request in flight", file=sys.stderr)
    client.fail_all()

@contextlib.contextmanager
def child_stopped_on_error(process, outbox):
    """Around the server's start of the engine core, from its spawn to its ready message. If
    Ctrl-C (or any error) breaks it off, the engine core stops at once, before the error goes
    on. The server closes outbox, its end of the engine core's outputs. The engine core sees it
    (follow_parent), and ends its workers and itself. One still importing torch watches nothing
    yet, so it is killed after a second."""
    try:
        yield
    except BaseException:
        outbox.close()
        if process.pid is not None:           # spawned
            process.join(1)
            if process.is_alive():
                process.kill()
                process.join()
        raise

_spawning = threading.Lock()   # held by sigint_held while children spawn (_exit_with waits)

@contextlib.contextmanager
def sigint_held():
    """Around spawning a process that leaves Ctrl-C to its parent (the chapter's opening): the
    engine core, a tensor-parallel worker. The child is born with SIGINT blocked, and a blocked
    signal waits. One that comes to this process meanwhile is held, then raised again once the
    child is spawned, to the handler that was there: a KeyboardInterrupt, or nothing in the
    engine core, which ignores it.
    multiprocessing's resource tracker unblocks SIGINT once it has started, so it starts first."""
    multiprocessing.resource_tracker.ensure_running()
    _spawning.acquire()
    main = threading.current_thread() is threading.main_thread()   # where signals are set
    held, sigint = [], signal.getsignal(signal.SIGINT) if main else None   # None: not Python's
    if sigint is not None:
        signal.signal(signal.SIGINT, lambda *_: held.append(1))
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
        if sigint is not None:
            signal.signal(signal.SIGINT, sigint)
        _spawning.release()
    if held:
        signal.raise_signal(signal.SIGINT)

def follow_parent(outbox=None):
    """First in a process spawned under sigint_held, whose parent stops it by closing its pipe.
    SIGINT and SIGTERM are the parent's to act on, so they are ignored here (a blocked one that
    waits is dropped with them). A parent that dies first, however it went (Ctrl-C while this
    child starts, SIGKILL), ends this process at once, by _exit_with: no one would read its pipe
    again, and on a GPU a collective waiting for a dead rank 0 never returns. The engine core
    also watches its outbox (child_stopped_on_error)."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    ends = [multiprocessing.parent_process().sentinel, *([outbox] if outbox is not None else [])]
    threading.Thread(target=_exit_with, args=(ends,), name="nanoserve-parent-watch",
                     daemon=True).start()

def _exit_with(ends):
    """Waits until the parent has exited (its sentinel turns readable) or the outbox's reader is
    gone (a pipe's sending end then turns ready, with an error). Then it kills this process's
    children, a tensor-parallel rank 0's workers, since one still importing torch would not see
    its parent's death until the import ends. Then this process exits. A child being spawned
    (sigint_held) is waited for: were this process to exit before it sends the child its
    start-up data, the child would print a traceback of that pipe's EOF."""
    multiprocessing.connection.wait(ends)
    with _spawning:
        for child in multiprocessing.active_children():
            child.kill()
        os._exit(1)

# ---------------------------------------------------------------------------
# The default engine
# What LLM, `generate` and `serve` run unless --part-one: part one's classes with the chapters'
# extensions. In each class below, a method runs the chapters' versions left to right, each
# handing on to the next with super(), and part one's last. So the order says who wraps whom:
# prefix caching's _commit names the blocks after async scheduling's has read the step back,
# and speculative decoding's schedule adds drafts to the batch the others have built. fp8
# weights' load_model quantizes what tensor parallelism's builds (a rank's shard). The log-probs'
# FrontEnd.process cuts the log-probs of the tokens a stop string has cut. In the
# server, APIServer comes first: its routes() puts the Responses route behind the API key too.
# Two part-one functions are wrapped here too: generate's speed line (with_drafts_accepted) and
# LLM.run (ends_every_request). LLM is part one's class, so its --part-one runs get both. And
# the name SamplingParams comes to mean the default engine's (DefaultSamplingParams), which
# LLM's callers, the server and the CLI make; under --part-one, FrontEnd.validate refuses any
# of its fields beyond part one's that is not at its default.

@dataclass
class DefaultEngineCoreOutput(LogprobsOutput, PrefixCachingOutput):
    pass

class DefaultSequence(SpeculativeSequence, PrefixCachingSequence, GrammarSequence,
                      LogprobsSequence, AsyncSequence, Sequence):
    pass

class DefaultScheduler(SpeculativeScheduler, BurstRuleScheduler, PrefixCachingScheduler,
                       AsyncScheduler, Scheduler):
    pass

class DefaultRunner(SpeculativeRunner, CUDAGraphRunner, Fp8WeightsRunner, TensorParallelRunner,
                   Fp8KVCacheRunner, GrammarRunner, LogprobsRunner, AsyncRunner, ModelRunner):
    pass

class DefaultEngineCore(SpeculativeEngineCore, PrefixCachingEngineCore, GrammarEngineCore,
                        LogprobsEngineCore, AsyncEngineCore, EngineCore):
    allocator_class, scheduler_class, runner_class = PrefixCachingAllocator, DefaultScheduler, \
        DefaultRunner
    sequence_class, output_class = DefaultSequence, DefaultEngineCoreOutput

class DefaultRequestState(StopStringRequestState, IncrementalRequestState, LogprobsRequestState,
                          PrefixCachingRequestState, RequestState):
    pass

@dataclass
class DefaultSamplingParams(StopStringParams, GrammarParams, LogprobsParams, SamplingParams):
    pass

class DefaultFrontEnd(LogprobsFrontEnd, StopStringFrontEnd, IncrementalFrontEnd, GrammarFrontEnd,
                      PrefixCachingFrontEnd, FrontEnd):
    state_class = DefaultRequestState

class DefaultClient(MetricsClient, EngineCoreProcessClient):
    pass

class DefaultServer(APIServer, ResponsesServer, GrammarServer, LogprobsServer, OpenAIServer):
    pass

LLM.engine_class = DefaultEngineCore
SamplingParams = DefaultSamplingParams       # what LLM's callers, the server and the CLI make
speed_line = with_drafts_accepted(speed_line)
LLM.run = ends_every_request(LLM.run)
LLM.front_class = EngineCoreClient.front_class = DefaultFrontEnd
EngineCoreClient.server_class = DefaultServer

def main(argv=None):
    """The CLI (its section in part one): `generate` runs LLM, whose engine is set above, and
    `serve` the engine core process's client, or with --part-one part one's engine in both."""
    args = build_parser().parse_args(argv)
    try:
        ensure_default_model(args.model)
        cfg = from_flags(Config, args)
        if args.command == "generate":
            run_generate(cfg, args.prompt, from_flags(SamplingParams, args))
        else:
            serve(cfg, EngineCoreClient if cfg.part_one else DefaultClient)
    except (ValueError, OSError) as e:        # bad input: one line, no traceback
        sys.exit(f"error: {e}")
    except KeyboardInterrupt:
        sys.exit(130)

if __name__ == "__main__":
    main()
