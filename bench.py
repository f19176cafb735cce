"""
Benchmarks for nanoserve, each next to a baseline run in the same process on
the same inputs.

    throughput  offline generation of many random requests: nanoserve against
                transformers `generate` (static batches), transformers
                `generate_batch` (its continuous batching) and vLLM if installed
    latency     batch-1 decode (ms/token, GB/s) with a per-kernel table of its
                step on a GPU (each GEMV's GB/s), prefill (TFLOP/s), and decode
                tok/s as the batch grows; nanoserve against transformers; on
                a CPU also the two first-impression workloads (one sequence, a
                long prompt) with both systems side by side and their ratio
    serve       the HTTP server under Poisson arrivals and a closed loop,
                with CUDA graphs and with --enforce-eager: TTFT, TPOT and
                inter-token percentiles, their distributions as a plot, and
                all at once each request's TTFT against the order sent
    kernel      the paged-attention decode kernel against its torch reference
                and SDPA on contiguous K/V, over batch x context
    prefix      shared-prefix requests with prefix caching on and off
    structured  offline throughput with 0%, 10% and 100% of the requests
                constrained to a JSON schema, 10% and 100% under tool_choice
                "auto"'s grammar, and the host time of the grammars
    host        the host's microseconds per phase of a steady decode step (schedule,
                prepare, launch, sample, commit, the front end) at each batch
                size, beside the device's for the step's CUDA graph alone
    model       no benchmark: builds a random model's folder and prints its
                path, to serve (with --tokenizer, a real tokenizer and a chat
                template in the family's format: every family's chat and tool
                calls, offline)
    spec        speculative decoding (prompt lookup): on a CPU, one sequence of
                the real model on four tasks (copy, rename in code, answer
                from a document, open-ended), nanoserve with and without
                drafts and transformers' prompt_lookup_num_tokens with and
                without; on a GPU, the verify step against a decode step by
                batch size, offline throughput on and off, bf16 agreement

Every number is taken after a warm-up and with the device synchronized, and
each setting prints one line with a hardware-relative figure next to the raw
one: GB/s and % of the device copy bandwidth for decode (measured at start-up
in the same run), TFLOP/s and % of a measured matmul (bf16 on the GPU) for
prefill. Speed does not depend on weight values, so `--random llama-3.2-1b`
builds Llama-3.2-1B's exact shapes with random weights (no download needed);
`--random llama-3.1-8b --tensor-parallel-size 2` runs Llama-3.1-8B's over two
GPUs (the hardware figures are one GPU's), and `--random qwen3-0.6b` or
`qwen3-8b` a Qwen3's (its per-head q and k norms).

Left out on purpose: accuracy (see the tests), sampling
(everything decodes greedily with EOS ignored, so each request generates
exactly the tokens it asked for).

GPU (H100/H200; the model defaults to --random llama-3.2-1b there):
    python bench.py throughput --hf-num-seqs 64 --json bench_out/throughput.json
    python bench.py latency --json bench_out/latency.json
    python bench.py serve --json bench_out/serve.json      # 400 requests at 32/s and at once
    python bench.py kernel --json bench_out/kernel.json
    python bench.py prefix --json bench_out/prefix.json
    python bench.py structured --tokenizer weights/SmolLM2-135M-Instruct --json bench_out/structured.json
    python bench.py spec --json bench_out/spec.json
    python bench.py host --json bench_out/host.json
  (throughput without --hf-num-seqs runs transformers on all 256 requests:
  several minutes more; --model DIR runs a real checkpoint instead)

CPU, the real model (the speed section of the README):
    python bench.py latency --device cpu --model weights/SmolLM2-135M-Instruct
    python bench.py spec --device cpu --model weights/SmolLM2-135M-Instruct --num-threads 1

CPU smoke (checks that every path runs, in under a minute each; the numbers
mean nothing):
    python bench.py throughput --device cpu --random tiny
    python bench.py latency --device cpu --random tiny
    python bench.py serve --device cpu --random tiny
    python bench.py prefix --device cpu --random tiny
    python bench.py tp --device cpu --random tiny
    python bench.py structured --device cpu --model weights/SmolLM2-135M-Instruct
    python bench.py spec --device cpu --model weights/SmolLM2-135M-Instruct --num-tasks 1 --output-len 8 --repeats 1
    python bench.py host --device cpu --random tiny
    TRITON_INTERPRET=1 python bench.py kernel --device cpu

Dimension letters: B sequences in a batch, T tokens of one sequence, n_heads
query heads, n_kv key/value heads, hd head dim, V vocabulary, D hidden size.
"""

import argparse
import asyncio
import gc
import importlib.util
import json
import math
import os
import platform
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
import traceback
import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch

# Every model here is a local folder: never ask the hub (the GPU machine has no
# network, and transformers probes the hub for optional attention kernels).
os.environ.setdefault("HF_HUB_OFFLINE", "1")
REPO_DIR = Path(__file__).resolve().parent
RESULTS = []  # every report(), written by --json

# ---------------------------------------------------------------------------
# Measuring
# Timers that synchronize the device, and the two hardware ceilings every
# result is compared with: copy bandwidth (decode is bound by reading memory)
# and matmul throughput (prefill is bound by math).


def log(msg):
    print(f"[bench] {msg}", flush=True)


def sync(device):
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def timed(fn, device):
    """Wall seconds of one call of fn, the device synchronized on both sides."""
    sync(device)
    t0 = time.perf_counter()
    result = fn()
    sync(device)
    return time.perf_counter() - t0, result


def mean_seconds(fn, device, iters):
    """Mean over iters back-to-back calls after one warm-up call: the sync at
    each end is paid once, not per call."""
    fn()
    return timed(lambda: [fn() for _ in range(iters)], device)[0] / iters


def measure_copy_gbps(device):
    """Device-to-device copy of a buffer far larger than any cache; a copy
    reads and writes every byte, so both count (the usual convention)."""
    cuda = str(device).startswith("cuda")
    nbytes = (1 << 30) if cuda else (1 << 27)
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    seconds = mean_seconds(lambda: dst.copy_(src), device, 20 if cuda else 5)
    return 2 * nbytes / seconds / 1e9


def measure_matmul_tflops(device, dtype):
    n = 8192 if str(device).startswith("cuda") else 1024
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    seconds = mean_seconds(lambda: a @ b, device, 10)
    return 2 * n**3 / seconds / 1e12


def hardware_info(device, dtype):
    log("measuring copy bandwidth and matmul throughput")
    cuda = str(device).startswith("cuda")
    info = {
        "device": torch.cuda.get_device_name() if cuda else f"cpu ({platform.processor() or 'unknown'}, "
                                                            f"{torch.get_num_threads()} threads)",
        "torch": torch.__version__,
        "transformers": _version("transformers"),
        "triton": _version("triton"),
        "copy_GB_s": measure_copy_gbps(device),
        "matmul_TFLOP_s": measure_matmul_tflops(device, dtype),
        "matmul_dtype": str(dtype).replace("torch.", ""),
    }
    free_memory()
    log(f"{info['device']}: copy {info['copy_GB_s']:.0f} GB/s, "
        f"{info['matmul_dtype']} matmul {info['matmul_TFLOP_s']:.3g} TFLOP/s")
    return info


def _version(module):
    try:
        return __import__(module).__version__
    except ImportError:
        return None


def free_memory():
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def percentile(xs, q):
    if not xs:
        return float("nan")
    xs = sorted(xs)
    k = (len(xs) - 1) * q / 100  # linear interpolation between closest ranks
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


# ---------------------------------------------------------------------------
# Reporting
# One aligned line per (system, setting); the same numbers go to --json.


def record(system, setting, **numbers):
    RESULTS.append({"system": system, "setting": setting, **numbers})


def _fmt(v):
    if isinstance(v, int):
        return f"{v:>8d}"
    if isinstance(v, float):
        if v != 0 and abs(v) < 0.01:
            return f"{v:>8.1e}"
        return f"{v:>8.1f}" if abs(v) >= 100 else f"{v:>8.2f}"
    return str(v)


def report(system, setting, **numbers):
    record(system, setting, **numbers)
    cells = "  ".join(f"{k} {_fmt(v)}" for k, v in numbers.items())
    print(f"{system:<28} {setting:<40} {cells}", flush=True)


def write_json(path, mode, args, hardware):
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    doc = {"mode": mode, "args": vars(args), "hardware": hardware, "results": RESULTS}
    Path(path).write_text(json.dumps(_jsonable(doc), indent=1))
    log(f"wrote {path}")


def _jsonable(x):
    """Strict JSON: inf and nan become strings ("inf" rate, "nan" for no data), torch dtypes their names."""
    if isinstance(x, dict):
        return {k: _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    return x if isinstance(x, (int, float, str, bool, type(None))) else str(x)


def save_plot(fig, out_dir, name):
    path = Path(out_dir) / name
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    log(f"wrote {path}")


def log2_xaxis(ax, values):
    """A log-2 x axis labelled with the values measured, not powers of ten."""
    from matplotlib.ticker import NullLocator
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted(values), [str(v) for v in sorted(values)])
    ax.xaxis.set_minor_locator(NullLocator())


def pyplot():
    import matplotlib
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt
    return plt


# ---------------------------------------------------------------------------
# Models
# A random-weight model with real shapes (a Llama, or the family its spec's model_type names) is
# saved once as safetensors with a synthetic tokenizer ("<t{id}>" for every id), so the server
# can detokenize random token ids. ModelShape holds the sizes the GB/s and FLOP counts need.

RANDOM_MODELS = {
    "llama-3.2-1b": dict(
        hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, head_dim=64, vocab_size=128256, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        max_position_embeddings=131072, tie_word_embeddings=True, rms_norm_eps=1e-5,
        bos_token_id=128000, eos_token_id=128001),
    # too large for one GPU at 70B; at 8B the shapes tensor parallelism is measured on
    "llama-3.1-8b": dict(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, vocab_size=128256, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        max_position_embeddings=131072, tie_word_embeddings=False, rms_norm_eps=1e-5,
        bos_token_id=128000, eos_token_id=128001),
    # Qwen3: an RMSNorm over each head of q and k; head_dim 128 is not D / n_heads at 0.6B
    "qwen3-0.6b": dict(
        model_type="qwen3", hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
        num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=151936,
        rope_theta=1000000.0, max_position_embeddings=40960, tie_word_embeddings=True,
        rms_norm_eps=1e-6, bos_token_id=151643, eos_token_id=151645),
    "qwen3-8b": dict(
        model_type="qwen3", hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936,
        rope_theta=1000000.0, max_position_embeddings=40960, tie_word_embeddings=False,
        rms_norm_eps=1e-6, bos_token_id=151643, eos_token_id=151645),
    # head_dim 16: the smallest the Triton kernels take (tl.dot needs >= 16)
    "tiny": dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, vocab_size=512, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 256},
        max_position_embeddings=4096, tie_word_embeddings=True, rms_norm_eps=1e-5,
        bos_token_id=1, eos_token_id=2),
}
# Each other family the engine serves, as small as "tiny" ("tiny" is the Llama): to try a family
# offline (`bench.py model`), not to time it. Qwen3's head_dim is not D / n_heads, as at 0.6B.
_TINY = {k: v for k, v in RANDOM_MODELS["tiny"].items() if k != "rope_scaling"}
RANDOM_MODELS |= {
    "qwen3-tiny": _TINY | dict(model_type="qwen3", head_dim=32),
    "qwen2.5-tiny": _TINY | dict(model_type="qwen2", use_sliding_window=False),  # q, k, v biases
    "mistral-tiny": _TINY | dict(model_type="mistral", sliding_window=None,
                                 tie_word_embeddings=False),
}

# A chat template in each family's own format, by model_type, for a random model that borrows a
# tokenizer (--tokenizer): the borrowed one's template would give every family its tool calls.
# Each renders the tools, earlier calls (name first, as models are trained) and their results as
# the family's checkpoints do, in fewer words. nanoserve reads the family's format from it
# (tool_call_format). A turn ends with the tokenizer's EOS: in the family's own tokenizer, that
# is its end of turn.
LLAMA3_TEMPLATE = (   # Llama 3.1 and 3.2: tools in the first user turn, a call as bare JSON
    "{% set ns = namespace(told=false) %}{% for m in messages %}<|start_header_id|>"
    "{{ 'ipython' if m.role == 'tool' else m.role }}<|end_header_id|>\n\n"
    "{% if tools and m.role == 'user' and not ns.told %}{% set ns.told = true %}"
    "Answer with a JSON object {\"name\": function name, \"parameters\": its arguments}, "
    "or in text. The functions:\n\n{% for t in tools %}{{ t | tojson }}\n\n{% endfor %}{% endif %}"
    "{% for c in m.tool_calls or [] %}{{ '; ' if not loop.first }}{\"name\": "
    "{{ c.function.name | tojson }}, \"parameters\": {{ c.function.arguments | tojson }}}"
    "{% endfor %}"
    "{{ m.content }}{{ eos_token }}{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
HERMES_TEMPLATE = (   # Qwen2.5 and Qwen3: tools in the system turn, a call in <tool_call> tags
    "{% set tools_turn = tools and messages[0].role == 'system' %}{% if tools %}"
    "<|im_start|>system\n{{ messages[0].content + '\n\n' if tools_turn }}# Tools\n\n"
    "You may call functions. Their signatures:\n<tools>\n{% for t in tools %}{{ t | tojson }}\n"
    "{% endfor %}</tools>\nTo call one, answer <tool_call>\n{\"name\": function name, "
    "\"arguments\": its arguments}\n</tool_call><|im_end|>\n{% endif %}"
    "{% for m in messages[1 if tools_turn else 0:] %}{% if m.role == 'tool' %}<|im_start|>user\n"
    "<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n{% else %}"
    "<|im_start|>{{ m.role }}\n{{ m.content }}{% for c in m.tool_calls or [] %}"
    "{{ '\n' if m.content or not loop.first }}<tool_call>\n{\"name\": "
    "{{ c.function.name | tojson }}, \"arguments\": {{ c.function.arguments | tojson }}}"
    "\n</tool_call>{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
MISTRAL_TEMPLATE = (   # Mistral v0.3: tools and the system turn before the last [INST]
    "{% set ns = namespace(last=-1) %}{% for m in messages %}{% if m.role == 'user' %}"
    "{% set ns.last = loop.index0 %}{% endif %}{% endfor %}"
    "{% set system = messages[0].content + '\n\n' if messages[0].role == 'system' else '' %}"
    "{% for m in messages %}{% if m.role == 'user' %}{% if loop.index0 == ns.last %}"
    "{% if tools %}[AVAILABLE_TOOLS] {{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}"
    "[INST] {{ system }}{% else %}[INST] {% endif %}{{ m.content }}[/INST]"
    "{% elif m.role == 'tool' %}[TOOL_RESULTS] "
    "{{ {'content': m.content, 'call_id': m.tool_call_id} | tojson }}[/TOOL_RESULTS]"
    "{% elif m.tool_calls %}[TOOL_CALLS] [{% for c in m.tool_calls %}"
    "{% if not (c.id is string and c.id | length == 9 and c.id.isalnum()) %}"
    "{{ raise_exception('a tool call id must be 9 letters or digits') }}{% endif %}"
    "{\"name\": {{ c.function.name | tojson }}, \"arguments\": "
    "{{ c.function.arguments | tojson }}, \"id\": {{ c.id | tojson }}}"
    "{{ ', ' if not loop.last }}{% endfor %}]{{ eos_token }}"
    "{% elif m.role == 'assistant' %} {{ m.content }}{{ eos_token }}{% endif %}{% endfor %}")
CHAT_TEMPLATES = {"llama": LLAMA3_TEMPLATE, "qwen2": HERMES_TEMPLATE, "qwen3": HERMES_TEMPLATE,
                  "mistral": MISTRAL_TEMPLATE}


def write_tokenizer(path, vocab_size, bos_id, eos_id, max_len):
    from tokenizers import Tokenizer, models, pre_tokenizers
    tok = Tokenizer(models.WordLevel({f"<t{i}>": i for i in range(vocab_size)}, unk_token="<t0>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": f"<t{bos_id}>",
        "eos_token": f"<t{eos_id}>", "unk_token": "<t0>", "model_max_length": max_len}, indent=1))


def build_random_model(name, out_dir, device, tokenizer=None):
    """Build, save and return the folder of a random-weight model; reused when present. With a
    tokenizer folder, the model takes its tokenizer, its tokenizer_config.json with the family's
    chat template (CHAT_TEMPLATES) in place of the folder's, and its vocabulary's size, BOS and
    EOS."""
    path = Path(out_dir) / (f"random-{name}" + (f"-{Path(tokenizer).name}" if tokenizer else ""))
    if (path / "tokenizer.json").is_file() and any(path.glob("*.safetensors")):
        return path
    from transformers import AutoConfig, AutoModelForCausalLM
    log(f"building random {name} on {device} into {path}")
    spec = dict(RANDOM_MODELS[name])
    model_type = spec.pop("model_type", "llama")     # the transformers class that builds it
    if tokenizer:
        config = json.loads((Path(tokenizer) / "config.json").read_text())
        spec.update({k: config[k] for k in ("vocab_size", "bos_token_id", "eos_token_id")})
    torch.manual_seed(0)
    with torch.device(device):  # init on the device: seconds instead of minutes for 1B
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **spec))
    tmp = path.with_name(path.name + ".tmp")  # rename at the end: no half-written model is reused
    shutil.rmtree(tmp, ignore_errors=True)
    model.to("cpu", torch.bfloat16).save_pretrained(tmp)
    if tokenizer:
        shutil.copy(Path(tokenizer) / "tokenizer.json", tmp / "tokenizer.json")
        tokenizer_config = json.loads((Path(tokenizer) / "tokenizer_config.json").read_text())
        tokenizer_config["chat_template"] = CHAT_TEMPLATES[model_type]
        (tmp / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=1))
    else:
        write_tokenizer(tmp, spec["vocab_size"], spec["bos_token_id"], spec["eos_token_id"],
                        spec["max_position_embeddings"])
    shutil.rmtree(path, ignore_errors=True)
    tmp.rename(path)
    del model
    free_memory()
    return path


@dataclass
class ModelShape:
    num_params: int        # every weight once (a tied lm_head counted once)
    num_layer_params: int  # decoder layers only: the matmuls every token goes through
    num_lookup_params: int  # an untied input embedding, of which a step reads only B rows; else 0
    vocab_size: int        # V
    hidden_size: int       # D
    intermediate_size: int  # I, of the MLP
    num_layers: int
    num_heads: int         # n_heads
    num_kv_heads: int      # n_kv
    head_dim: int          # hd
    dtype_bytes: int       # of the weights as run
    layer_weight_bytes: int  # of a decoder layer's weights as run: 1 with --quantization fp8
    kv_element_bytes: int  # of a K or V value in the pool: 1 with --kv-cache-dtype fp8

    @property
    def kv_bytes_per_token(self):  # K and V of every layer
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.kv_element_bytes

    def decode_step_bytes(self, B, ctx):
        """Least bytes one decode step must read: every weight once (a tied
        embedding as the lm_head), plus the KV of B sequences at mean context ctx."""
        weights = ((self.num_params - self.num_lookup_params - self.num_layer_params) * self.dtype_bytes
                   + self.num_layer_params * self.layer_weight_bytes)
        return weights + B * ctx * self.kv_bytes_per_token

    def gemv_bytes(self):
        """Weight bytes of each matmul of a decode step, in launch order: the
        four of every layer, then the LM head."""
        D, hd, w = self.hidden_size, self.head_dim, self.layer_weight_bytes
        return {"qkv": (self.num_heads + 2 * self.num_kv_heads) * hd * D * w,
                "o": D * self.num_heads * hd * w,
                "gate_up": 2 * self.intermediate_size * D * w,
                "down": D * self.intermediate_size * w,
                "LM head": self.vocab_size * D * self.dtype_bytes}

    def prefill_flops(self, T):
        """Matmul FLOPs of one T-token prefill: 2 per weight per token in the
        layers, the lm_head for the last token only, and causal attention
        (q k^T and p v over T^2 / 2 pairs each, 2 FLOPs per multiply-add)."""
        attention = 2 * self.num_layers * self.num_heads * self.head_dim * T * T
        return 2 * self.num_layer_params * T + 2 * self.vocab_size * self.hidden_size + attention

    def generation_flops(self, num_prompt_tokens, num_output_tokens):
        """Matmul FLOPs of a workload, attention left out: layers for every
        token, the lm_head for every output token."""
        per_output = 2 * (self.num_layer_params + self.vocab_size * self.hidden_size)
        return 2 * self.num_layer_params * num_prompt_tokens + per_output * num_output_tokens


def model_shape(model_dir, dtype, quantization=None, kv_cache_dtype=None):
    from transformers import AutoConfig, AutoModelForCausalLM
    cfg = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):  # shapes without memory
        model = AutoModelForCausalLM.from_config(cfg)
    n_heads = cfg.num_attention_heads
    return ModelShape(
        num_params=sum(p.numel() for p in model.parameters()),
        num_layer_params=sum(p.numel() for p in model.model.layers.parameters()),
        num_lookup_params=0 if cfg.tie_word_embeddings else model.get_input_embeddings().weight.numel(),
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size, num_layers=cfg.num_hidden_layers,
        num_heads=n_heads, num_kv_heads=getattr(cfg, "num_key_value_heads", None) or n_heads,
        head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // n_heads,
        dtype_bytes=dtype.itemsize, layer_weight_bytes=1 if quantization == "fp8" else dtype.itemsize,
        kv_element_bytes=1 if kv_cache_dtype == "fp8" else dtype.itemsize)


def load_hf_model(model_dir, args):
    from transformers import AutoModelForCausalLM
    log(f"loading transformers model from {model_dir}")
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=args.torch_dtype).to(args.device).eval()


def random_prompts(rng, vocab_size, lengths):
    return [[rng.randrange(vocab_size) for _ in range(n)] for n in lengths]


# ---------------------------------------------------------------------------
# Systems
# Each takes requests as (prompt token ids, exact number of output tokens),
# decodes greedily with EOS ignored, and returns the wall seconds of the timed
# part and the output tokens it counts per request. Warm-up is never timed.


ENGINE_FLAGS = ("block_size", "num_blocks", "max_num_seqs", "max_num_batched_tokens", "attention",
                "enforce_eager", "tensor_parallel_size", "quantization",
                "kv_cache_dtype")  # passed to nanoserve only when set


def make_llm(args, model_dir, ns=None, **overrides):
    LLM = (ns or importlib.import_module("nanoserve")).LLM
    kwargs = {k: getattr(args, k) for k in ENGINE_FLAGS if getattr(args, k) is not None}
    kwargs.update(overrides)
    log(f"starting nanoserve LLM({model_dir.name}, {kwargs})")
    return LLM(str(model_dir), device=args.device, dtype=args.dtype, **kwargs)


def nanoserve_generate(llm, prompts, max_tokens, ns=None):
    """Greedy, EOS ignored; max_tokens is one int or one per prompt (ns: another nanoserve
    module than the one on the path)."""
    SamplingParams = (ns or importlib.import_module("nanoserve")).SamplingParams
    counts = max_tokens if isinstance(max_tokens, list) else [max_tokens] * len(prompts)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in counts]
    return llm.generate(prompts, params)


def run_nanoserve(args, model_dir, requests):
    llm = make_llm(args, model_dir)
    nanoserve_generate(llm, [[1] * 16], 4)  # warm-up
    seconds, outs = timed(lambda: nanoserve_generate(llm, [p for p, _ in requests],
                                                     [n for _, n in requests]), args.device)
    return seconds, [len(o.token_ids) for o in outs]


def hf_generate(model, prompts, num_new_tokens):
    """One static batch, left-padded so every row ends at the same position.
    min_new_tokens == max_new_tokens masks EOS, so the batch runs exactly
    num_new_tokens steps."""
    T = max(len(p) for p in prompts)
    pad = 0  # any id: masked out by attention_mask
    ids = torch.tensor([[pad] * (T - len(p)) + p for p in prompts], device=model.device)  # (B, T)
    mask = torch.tensor([[0] * (T - len(p)) + [1] * len(p) for p in prompts], device=model.device)
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=num_new_tokens,
                             min_new_tokens=num_new_tokens, do_sample=False, pad_token_id=pad)
    assert out.shape == (len(prompts), T + num_new_tokens), out.shape
    return out


def run_hf_generate(args, model_dir, requests):
    """Static batching: requests go in arrival order in batches of
    --hf-batch-size; a batch runs until its longest request is done, so short
    requests idle in it. Only each request's own tokens count as output; the
    wasted steps are the cost of static batching and stay in the time."""
    model = load_hf_model(model_dir, args)
    hf_generate(model, [[1] * 16], 4)  # warm-up
    bs = args.hf_batch_size
    sync(args.device)
    t0 = time.perf_counter()
    for i in range(0, len(requests), bs):
        batch = requests[i:i + bs]
        hf_generate(model, [p for p, _ in batch], max(n for _, n in batch))
        log(f"  transformers-generate: {i + len(batch)}/{len(requests)} requests, "
            f"{time.perf_counter() - t0:.1f} s")
    sync(args.device)
    return time.perf_counter() - t0, [n for _, n in requests]


def hf_continuous_batching(model, requests):
    """transformers' continuous batching (the engine behind generate_batch),
    driven through its manager so each request gets its own max_new_tokens:
    generate_batch itself takes one max_new_tokens for all. The manager is
    sized and warmed up (CUDA graphs) on entering the context, before timing.
    Returns (seconds, generated token counts)."""
    from transformers import GenerationConfig
    max_new = max(n for _, n in requests)
    # eos_token_id=-1 matches no token: EOS is ignored, as in every system here
    config = GenerationConfig(max_new_tokens=max_new, do_sample=False, eos_token_id=-1)
    hints = {}
    try:  # sizes the cache for this workload, as generate_batch does
        from transformers.generation.continuous_batching.utils import WorkloadHints
        hints["workload_hints"] = WorkloadHints(max_prompt_length=max(len(p) for p, _ in requests),
                                                max_generated_length=max_new, num_requests=len(requests))
    except ImportError:
        pass
    if model.device.type == "cpu":
        # Its default cache on cpu comes with a dense attention mask that takes
        # half a minute to clear: a small one keeps the smoke test quick.
        from transformers import ContinuousBatchingConfig
        hints["continuous_batching_config"] = ContinuousBatchingConfig(num_blocks=8, max_batch_tokens=256)
    results = {}
    with model.continuous_batching_context_manager(generation_config=config, block=True, timeout=5,
                                                   **hints) as manager:
        t0 = time.perf_counter()
        for i, (prompt, n) in enumerate(requests):
            manager.add_request(prompt, request_id=f"r{i}", max_new_tokens=n, eos_token_id=-1)
        while len(results) < len(requests):
            out = manager.get_result(timeout=1)
            if out is None and not manager.is_running():
                raise RuntimeError(f"continuous batching stopped after {len(results)} requests")
            if out is not None and out.is_finished():
                if out.error is not None:
                    raise RuntimeError(f"request {out.request_id} failed: {out.error}")
                results[out.request_id] = len(out.generated_tokens)
                if len(results) % max(1, len(requests) // 8) == 0:
                    log(f"  transformers-generate_batch: {len(results)}/{len(requests)} requests, "
                        f"{time.perf_counter() - t0:.1f} s")
        seconds = time.perf_counter() - t0  # tokens reach the host before a result is queued
    return seconds, [results[f"r{i}"] for i in range(len(requests))]


def run_hf_generate_batch(args, model_dir, requests):
    model = load_hf_model(model_dir, args)
    hf_continuous_batching(model, [([1] * 16, 4), ([2] * 8, 8)])  # warm-up
    return hf_continuous_batching(model, requests)


def run_vllm(args, model_dir, requests):
    import vllm
    max_len = max(len(p) + n for p, n in requests) + 16
    llm = vllm.LLM(model=str(model_dir), load_format="dummy", dtype=args.dtype, seed=0,
                   max_model_len=max_len, gpu_memory_utilization=0.85)
    greedy = lambda n: vllm.SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0)  # noqa: E731
    llm.generate([{"prompt_token_ids": [1] * 16}], [greedy(4)], use_tqdm=False)  # warm-up
    prompts = [{"prompt_token_ids": p} for p, _ in requests]
    seconds, outs = timed(lambda: llm.generate(prompts, [greedy(n) for _, n in requests]), args.device)
    return seconds, [len(o.outputs[0].token_ids) for o in outs]


SYSTEMS = {
    "nanoserve": run_nanoserve,
    "transformers-generate": run_hf_generate,
    "transformers-generate_batch": run_hf_generate_batch,
    "vllm": run_vllm,
}


DEFAULT_SYSTEMS = {
    "throughput": [s for s in SYSTEMS if s != "vllm" or importlib.util.find_spec("vllm") is not None],
    "latency": ["nanoserve", "transformers-generate"],
}


# ---------------------------------------------------------------------------
# Mode: throughput
# Random prompts and output lengths, uniform in the given ranges, seed 0;
# every system sees the same requests. transformers may run on the first
# --hf-num-seqs of them (it is slow); its setting then says so. mfu_pct is
# the workload's matmul FLOPs (attention left out) per second, as % of the
# measured matmul throughput.


def throughput(args, model_dir, hw):
    """Offline throughput of many random requests, against the baselines."""
    shape = model_shape(model_dir, args.torch_dtype, args.quantization, args.kv_cache_dtype)
    rng = random.Random(0)
    lengths = [(rng.randint(args.min_input, args.max_input), rng.randint(args.min_output, args.max_output))
               for _ in range(args.num_seqs)]
    prompts = random_prompts(rng, shape.vocab_size, [n_in for n_in, _ in lengths])
    requests = [(p, n_out) for p, (_, n_out) in zip(prompts, lengths)]
    log(f"{len(requests)} requests: {sum(len(p) for p, _ in requests)} prompt tokens, "
        f"{sum(n for _, n in requests)} output tokens")
    base = f"in {args.min_input}-{args.max_input} out {args.min_output}-{args.max_output}"
    bars = {}
    for system in args.systems:
        subset = requests
        setting = f"{len(requests)} seqs {base}"
        if system.startswith("transformers") and args.hf_num_seqs < len(requests):
            subset = requests[:args.hf_num_seqs]
            setting = f"first {len(subset)} of {len(requests)} {base}"
        log(f"running {system} on {len(subset)} requests")
        try:
            seconds, counted = SYSTEMS[system](args, model_dir, subset)
        except Exception:  # a failing baseline must not hide the others
            traceback.print_exc()
            log(f"{system} FAILED, skipped")
            continue
        finally:
            free_memory()
        asked = [n for _, n in subset]
        if counted != asked:
            log(f"WARNING {system}: generated {sum(counted)} tokens, asked for {sum(asked)}")
        n_prompt, n_out = sum(len(p) for p, _ in subset), sum(min(c, a) for c, a in zip(counted, asked))
        mfu = shape.generation_flops(n_prompt, n_out) / seconds / 1e12 / hw["matmul_TFLOP_s"]
        report(system, setting, output_tok_s=n_out / seconds, total_tok_s=(n_prompt + n_out) / seconds,
               mfu_pct=100 * mfu, seconds=seconds, num_seqs=len(subset))
        bars[system if subset is requests else f"{system}\n(first {len(subset)})"] = n_out / seconds
    plot_bars(bars, "output tokens/s", f"Offline throughput ({base})", args.out_dir, "throughput.png")


def plot_bars(values, ylabel, title, out_dir, name):
    if not values:
        return
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.bar(list(values), list(values.values()), color="tab:blue")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.tick_params(axis="x", labelsize=8)
    save_plot(fig, out_dir, name)


# ---------------------------------------------------------------------------
# Mode: latency
# (a) batch-1 decode, (b) prefill, (c) decode as the batch grows. For
# nanoserve, (a) uses the request's own timestamps (first token -> last
# token) and (b) its time to first token. transformers has no timestamps, so
# prefill is the time of generate(max_new_tokens=1) and decode is
# time(n tokens) - time(1 token) over n - 1 steps; (c) uses that difference
# for both systems, so a batch's prefill never counts as decode time.
# On a CPU, (d) times two whole requests, prompt to last token, greedy with
# EOS ignored and the prefix cache off: one sequence of --decode-len new
# tokens, and a --long-prompt-len prompt with --long-decode-len new tokens.
# Both systems stay loaded and take turns, best of --repeats each, so that a
# shared machine's load falls on both alike; x_transformers is the ratio of
# their times (above 1: nanoserve is faster).


def decode_line(system, setting, shape, hw, B, ctx, steps, seconds, **more):
    step = seconds / steps
    gbps = shape.decode_step_bytes(B, ctx) / step / 1e9
    report(system, setting, tok_s=B * steps / seconds, **more, ms_per_step=1e3 * step,
           weight_mb_per_tok=shape.decode_step_bytes(B, 0) / B / 1e6, gb_s=gbps,
           pct_copy=100 * gbps / hw["copy_GB_s"])
    return B * steps / seconds


def prefill_line(system, T, shape, hw, seconds):
    tflops = shape.prefill_flops(T) / seconds / 1e12
    report(system, f"prefill T={T}", tok_s=T / seconds, ttft_ms=1e3 * seconds, tflop_s=tflops,
           pct_matmul=100 * tflops / hw["matmul_TFLOP_s"])


def latency_nanoserve(args, model_dir, shape, hw, rng):
    # Prefix caching off: repeated prompts of the decode-by-difference runs must
    # be computed again. One step holds the longest prefill, so TTFT is one step.
    llm = make_llm(args, model_dir, enable_prefix_caching=False,
                   **({} if args.max_num_batched_tokens else
                      {"max_num_batched_tokens": max(8192, max(args.prefill_lens))}))
    nanoserve_generate(llm, random_prompts(rng, shape.vocab_size, [32, 48]), 8)  # warm-up
    # -- (a) batch-1 decode; with_prefill_tok_s: the whole request's wall time --
    o = nanoserve_generate(llm, random_prompts(rng, shape.vocab_size, [args.prompt_len]), args.decode_len)[0]
    decode_line("nanoserve", f"decode B=1 T={args.prompt_len}+{args.decode_len}", shape, hw, 1,
                args.prompt_len + args.decode_len / 2, len(o.token_ids) - 1,
                o.finish_time - o.first_token_time,
                with_prefill_tok_s=len(o.token_ids) / (o.finish_time - o.arrival_time))
    if args.device.startswith("cuda"):
        profile_batch1(llm, shape, rng, args)
    # -- (b) prefill --
    for T in args.prefill_lens:
        ttfts = []
        for _ in range(3):  # fresh prompts: nothing can come from a cache
            o = nanoserve_generate(llm, random_prompts(rng, shape.vocab_size, [T]), 1)[0]
            ttfts.append(o.first_token_time - o.arrival_time)
        prefill_line("nanoserve", T, shape, hw, statistics.median(ttfts))
    # -- (c) decode by batch size --
    return {B: decode_by_difference(
        "nanoserve", args, shape, hw, B, rng,
        lambda prompts, n: nanoserve_generate(llm, prompts, n)) for B in args.batch_sizes}


def profile_batch1(llm, shape, rng, args, steps=64):
    """Where one batch-1 decode token's time goes, kernel by kernel.

    torch.profiler records a request of steps + 1 new tokens and one of 1
    (its prefill and first token); their difference, over `steps`, is one
    decode step. Two times per kernel: its own (start to end, which under
    PDL includes waiting for the kernel before) and its exposed time (how
    far it moves the last end forward: summed over a step, the busy wall
    time). The GEMVs are told apart by their order in the step, and each
    one's GB/s is its weight bytes over either time."""
    from torch.profiler import ProfilerActivity, profile
    prompt = random_prompts(rng, shape.vocab_size, [args.prompt_len])
    runs = []
    for n in (1, steps + 1):
        nanoserve_generate(llm, prompt, n)                     # the same sizes, warm
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            nanoserve_generate(llm, prompt, n)
        runs.append([(e.name, e.time_range.start, e.time_range.end) for e in prof.events()
                     if e.device_type == torch.autograd.DeviceType.CUDA])
    rows = kernel_table(*runs, shape.gemv_bytes(), shape.num_layers)
    own, exposed = sum(r[2] for r in rows), sum(r[3] for r in rows)
    log(f"batch-1 decode, per token over {steps} steps: the device busy {exposed / steps:.0f} us, "
        f"{own / steps:.0f} us of kernel time, {sum(r[1] for r in rows) / steps:.0f} launches")
    seconds, waited = host_wait(llm, prompt, steps + 1)
    log(f"  without the profiler: {1e6 * seconds / (steps + 1):.0f} us a step, of which the host "
        f"waited {1e6 * waited / (steps + 1):.0f} us for the device (near 0: the host is the limit)")
    log(f"  {'kernel':<26} {'us own':>7} {'exposed':>7} {'launches':>8} {'GB/s own':>9} {'exposed':>8}")
    for name, n, us_own, us_exposed, nbytes in rows:
        gbps = "" if nbytes is None else f"{nbytes / us_own / 1e3:9.0f} {nbytes / us_exposed / 1e3:8.0f}"
        log(f"  {name:<26} {us_own / steps:7.1f} {us_exposed / steps:7.1f} {n / steps:8.1f} {gbps}")


def host_wait(llm, prompt, n):
    """Wall seconds of a request of n new tokens, and the part the host spent
    blocked on the device: the engine's one sync a step is an event's
    synchronize(), timed here by wrapping it for the run."""
    waited, sync = [0.0], torch.cuda.Event.synchronize
    def timed_sync(event):
        t0 = time.perf_counter()
        sync(event)
        waited[0] += time.perf_counter() - t0
    torch.cuda.Event.synchronize = timed_sync
    try:
        seconds, _ = timed(lambda: nanoserve_generate(llm, prompt, n), "cuda")
    finally:
        torch.cuda.Event.synchronize = sync
    return seconds, waited[0]


# Kernels of a decode step grouped under one name: the first prefix that
# matches (Triton names a kernel after its function). The GEMVs are named by
# their place in the step; all else (torch's sampling kernels, memory
# copies) shares one row.
KERNEL_GROUPS = (("_rope_store", "RoPE-store"), ("_decode_reduce", "decode merge"),
                 ("_decode", "decode attention"), ("_", "other Triton kernels"))


def kernel_table(short, long, gemv_bytes, num_layers):
    """Per-kernel totals of `long` minus `short`, each a list of (name, start
    us, end us) device events. Rows: (name, launches, us own, us exposed, weight bytes read or None),
    GEMVs first in launch order, then the rest by own time."""
    tables = []
    for events in (short, long):
        events = sorted(events, key=lambda e: e[2])
        totals, last_end = {}, -math.inf
        gemvs = [e for e in sorted(events, key=lambda e: e[1])
                 if e[0].startswith(("_gemv_kernel", "_skinny_kernel"))]  # whichever pa.linear took
        # the step's GEMVs in order, then the LM head: name them from the last one back
        roles = list(gemv_bytes)
        cycle = roles[:-1] * num_layers + roles[-1:]
        role_of = {id(e): cycle[(i - len(gemvs)) % len(cycle)] for i, e in enumerate(gemvs)}
        for e in events:
            name = role_of.get(id(e)) or next((g for key, g in KERNEL_GROUPS if e[0].startswith(key)),
                                              "sampling, copies, the rest")
            n, own, exposed = totals.get(name, (0, 0.0, 0.0))
            totals[name] = (n + 1, own + e[2] - e[1], exposed + max(0.0, e[2] - max(e[1], last_end)))
            last_end = max(last_end, e[2])
        tables.append(totals)
    diff = {name: tuple(a - b for a, b in zip(t, tables[0].get(name, (0, 0.0, 0.0))))
            for name, t in tables[1].items()}
    ordered = [r for r in gemv_bytes if r in diff] + sorted(
        (n for n in diff if n not in gemv_bytes), key=lambda n: -diff[n][1])
    rows = [(name, n, own, exposed, None if name not in gemv_bytes else n * gemv_bytes[name])
            for name, (n, own, exposed) in ((name, diff[name]) for name in ordered) if n > 0]
    return rows


def latency_transformers(args, model_dir, shape, hw, rng):
    model = load_hf_model(model_dir, args)
    hf_generate(model, random_prompts(rng, shape.vocab_size, [32]), 8)  # warm-up
    gen = lambda prompts, n: hf_generate(model, prompts, n)  # noqa: E731
    # -- (a) batch-1 decode --
    decode_by_difference("transformers-generate", args, shape, hw, 1, rng, gen, n=args.decode_len)
    # -- (b) prefill --
    for T in args.prefill_lens:
        seconds = statistics.median(
            timed(lambda: gen(random_prompts(rng, shape.vocab_size, [T]), 1), args.device)[0]
            for _ in range(3))
        prefill_line("transformers-generate", T, shape, hw, seconds)
    # -- (c) decode by batch size --
    return {B: decode_by_difference("transformers-generate", args, shape, hw, B, rng, gen)
            for B in args.batch_sizes}


def decode_by_difference(system, args, shape, hw, B, rng, gen, n=None):
    n = n or args.batch_decode_len
    prompts = random_prompts(rng, shape.vocab_size, [args.prompt_len] * B)
    t_one, _ = timed(lambda: gen(prompts, 1), args.device)
    t_all, _ = timed(lambda: gen(prompts, n), args.device)
    return decode_line(system, f"decode B={B} T={args.prompt_len}+{n}", shape, hw, B,
                       args.prompt_len + n / 2, n - 1, t_all - t_one)


def latency_cpu_workloads(args, model_dir, shape, hw, rng):
    """(d): two whole requests, both systems loaded side by side, taking turns."""
    llm = make_llm(args, model_dir, enable_prefix_caching=False,
                   **({} if args.max_num_batched_tokens else
                      {"max_num_batched_tokens": max(8192, args.long_prompt_len)}))
    model = load_hf_model(model_dir, args)
    systems = {"nanoserve": lambda prompt, n: nanoserve_generate(llm, [prompt], n),
               "transformers-generate": lambda prompt, n: hf_generate(model, [prompt], n)}
    for gen in systems.values():  # warm-up
        gen(random_prompts(rng, shape.vocab_size, [32])[0], 8)
    for T, n in ((args.prompt_len, args.decode_len), (args.long_prompt_len, args.long_decode_len)):
        prompt = random_prompts(rng, shape.vocab_size, [T])[0]  # the same one for both
        best = dict.fromkeys(systems, math.inf)
        for _ in range(args.repeats):
            for system, gen in systems.items():
                seconds = timed(lambda: gen(prompt, n), args.device)[0]
                log(f"  {system} T={T}+{n}: {seconds:.2f} s")
                best[system] = min(best[system], seconds)
        # hardware-relative: the matmul FLOPs of the request (attention left out) per second
        flops = shape.generation_flops(T, n)
        for system, seconds in best.items():
            tflops = flops / seconds / 1e12
            report(system, f"request T={T}+{n}", tok_s=n / seconds, seconds=seconds,
                   x_transformers=best["transformers-generate"] / seconds, tflop_s=tflops,
                   pct_matmul=100 * tflops / hw["matmul_TFLOP_s"])


def latency(args, model_dir, hw):
    """Batch-1 decode, prefill, decode tok/s as the batch grows; on cpu, whole requests too."""
    shape = model_shape(model_dir, args.torch_dtype, args.quantization, args.kv_cache_dtype)
    log(f"{shape.num_params / 1e6:.1f} M parameters, {shape.kv_bytes_per_token} KV bytes per token")
    curves = {}
    for system, fn in (("nanoserve", latency_nanoserve), ("transformers-generate", latency_transformers)):
        if system not in args.systems:
            continue
        try:
            curves[system] = fn(args, model_dir, shape, hw, random.Random(0))
        except Exception:
            traceback.print_exc()
            log(f"{system} FAILED, skipped")
        free_memory()
    if not args.device.startswith("cuda") and set(args.systems) >= {"nanoserve", "transformers-generate"}:
        latency_cpu_workloads(args, model_dir, shape, hw, random.Random(0))
        free_memory()
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for system, curve in curves.items():
        ax.plot(list(curve), list(curve.values()), marker="o", label=system)
    log2_xaxis(ax, args.batch_sizes)
    ax.set(yscale="log", xlabel="batch size", ylabel="decode tokens/s",
           title=f"Decode throughput, prompt {args.prompt_len}, {args.batch_decode_len} new tokens")
    ax.legend()
    save_plot(fig, args.out_dir, "latency_batch.png")


# ---------------------------------------------------------------------------
# Mode: serve
# The real server in a subprocess, driven over HTTP with streaming requests.
# Open loop: Poisson arrivals at a fixed rate (exponential gaps, seeded), so
# requests keep coming whether or not the server keeps up. Closed loop: a
# fixed number of clients, each sending its next request when one finishes.
# TTFT is send -> first content chunk; inter-token latency (ITL) is the gap
# between consecutive content chunks of a stream.


def start_server(args, model_dir, log_path):
    with socket.socket() as s:  # a free port, chosen by the OS
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, str(REPO_DIR / "nanoserve.py"), "serve", "--model", str(model_dir),
           "--host", "127.0.0.1", "--port", str(port), "--device", args.device, "--dtype", args.dtype]
    for k in ENGINE_FLAGS:
        v = getattr(args, k)
        if v is not None and v is not False:
            cmd += [f"--{k.replace('_', '-')}"] + ([] if v is True else [str(v)])
    log(f"starting {' '.join(cmd)} (log: {log_path})")
    with open(log_path, "w") as log_file:  # the child keeps its own copy of the handle
        # start_new_session: the server and any child it spawns form one group we can stop
        proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True)
    return proc, f"http://127.0.0.1:{port}"


def wait_healthy(proc, url, log_path, timeout):
    """Wait for /health, then return the model name the server expects."""
    import httpx
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with code {proc.returncode}:\n{_tail(log_path)}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                models = httpx.get(f"{url}/v1/models", headers=_auth(), timeout=10).json()
                return models["data"][0]["id"]
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise RuntimeError(f"server not healthy after {timeout} s:\n{_tail(log_path)}")


def _auth():
    key = os.environ.get("NANOSERVE_API_KEY")  # the server requires it when set
    return {"Authorization": f"Bearer {key}"} if key else {}


def stop_server(proc):
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _tail(path, n=30):
    return "\n".join(Path(path).read_text(errors="replace").splitlines()[-n:])


async def stream_request(session, url, payload):
    """One streaming completion: send time, content-chunk times, tokens, error."""
    start, times, num_tokens = time.perf_counter(), [], None
    try:
        async with session.post(f"{url}/v1/completions", json=payload) as resp:
            if resp.status != 200:
                error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return dict(start=start, times=times, num_tokens=0, error=error)
            async for line in resp.content:  # SSE: "data: {json}" lines, blank lines between
                if not line.startswith(b"data:"):
                    continue
                data = line[len(b"data:"):].strip()
                if data == b"[DONE]":
                    break
                chunk = json.loads(data)
                if chunk.get("usage"):
                    num_tokens = chunk["usage"].get("completion_tokens", num_tokens)
                choices = chunk.get("choices") or []
                if choices and choices[0].get("text"):
                    times.append(time.perf_counter())
    except Exception as e:  # a broken stream is a failed request, not a crashed benchmark
        return dict(start=start, times=times, num_tokens=0, error=repr(e))
    num_tokens = len(times) if num_tokens is None else num_tokens  # usage, when the server sends it
    return dict(start=start, times=times, num_tokens=num_tokens, error=None)


def _client(n):
    """aiohttp, the client of vLLM's and SGLang's serving benchmarks. With httpx, used before, 400
    requests sent at once first reached the server 0.69-0.75 s after they were sent (aiohttp:
    0.21-0.27 s; H200 host, 2026-11-24): the client's own time, counted as time to first token."""
    import aiohttp
    return aiohttp.ClientSession(headers=_auth(), timeout=aiohttp.ClientTimeout(total=600, connect=30),
                                 connector=aiohttp.TCPConnector(limit=n))


async def open_loop(url, payloads, rate, seed):
    rng = random.Random(seed)
    async with _client(len(payloads)) as client:
        t0, tasks = time.perf_counter(), []
        for p in payloads:
            tasks.append(asyncio.create_task(stream_request(client, url, p)))
            if math.isfinite(rate):
                await asyncio.sleep(rng.expovariate(rate))
        results = await asyncio.gather(*tasks)
    return results, time.perf_counter() - t0


async def closed_loop(url, payloads, concurrency):
    todo = iter(payloads)  # shared by the clients; asyncio runs one at a time

    async def client_loop(client):
        return [await stream_request(client, url, p) for p in todo]

    async with _client(concurrency) as client:
        t0 = time.perf_counter()
        per_client = await asyncio.gather(*(client_loop(client) for _ in range(concurrency)))
    return [r for rs in per_client for r in rs], time.perf_counter() - t0


def summarize_serve(setting, results, seconds, expected_tokens):
    ok = [r for r in results if r["error"] is None and r["times"]]
    failed = [r for r in results if r["error"] is not None or not r["times"]]
    if failed:
        log(f"WARNING {len(failed)} of {len(results)} requests failed, first: {failed[0]['error']}")
    short = sum(r["num_tokens"] != expected_tokens for r in ok)
    if short:
        log(f"WARNING {short} streams did not return {expected_tokens} tokens")
    ttft = [1e3 * (r["times"][0] - r["start"]) for r in ok]
    itl = [1e3 * (b - a) for r in ok for a, b in zip(r["times"], r["times"][1:])]
    # TPOT as vLLM's client counts it: a request's time after its first
    # token over its other tokens
    tpot = [1e3 * (r["times"][-1] - r["times"][0]) / (r["num_tokens"] - 1)
            for r in ok if r["num_tokens"] > 1]
    numbers = dict(req_s=len(ok) / seconds, output_tok_s=sum(r["num_tokens"] for r in ok) / seconds,
                   ttft_mean_ms=sum(ttft) / max(1, len(ttft)),
                   ttft_p50_ms=percentile(ttft, 50), ttft_p99_ms=percentile(ttft, 99),
                   tpot_p50_ms=percentile(tpot, 50),
                   itl_p50_ms=percentile(itl, 50), itl_p99_ms=percentile(itl, 99), num_failed=len(failed))
    report("nanoserve-server", setting, **numbers)
    return numbers, {"ttft": ttft, "itl": itl}


def serve(args, model_dir, hw):
    """The HTTP server under Poisson arrivals and a closed loop, with CUDA
    graphs and (on a GPU) with --enforce-eager too, then the same
    all-at-once requests offline through LLM.generate."""
    vocab = model_shape(model_dir, args.torch_dtype).vocab_size
    Path(args.out_dir).mkdir(parents=True, exist_ok=True)
    cuda = args.device.startswith("cuda")
    points, samples, all_at_once = [], {}, None   # all_at_once: (payloads, tok/s) of rate inf, graphs
    both = cuda and not args.enforce_eager and not args.graphs_only
    for eager in ([False, True] if both else [bool(args.enforce_eager)]):
        args.enforce_eager = eager or None
        mode = "eager" if eager else "graphs" if cuda else "cpu"
        log_path = Path(args.out_dir) / f"serve_{mode}.log"
        proc, url = start_server(args, model_dir, log_path)
        try:
            start = time.perf_counter()
            model_name = wait_healthy(proc, url, log_path, args.startup_timeout)
            log(f"{mode}: healthy after {time.perf_counter() - start:.1f} s")

            # Fresh prompts for every setting, so no setting is served from the
            # prefix cache that an earlier one filled.
            def payloads(seed, n):
                rng = random.Random(seed)
                return [{"model": model_name, "prompt": p, "max_tokens": args.output_len, "temperature": 0.0,
                         "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
                        for p in random_prompts(rng, vocab, [args.input_len] * n)]
            asyncio.run(closed_loop(url, payloads(10_000, 4), 2))  # warm-up
            lengths = f"in {args.input_len} out {args.output_len}"
            for i, rate in enumerate(args.rates):
                log(f"{mode}, rate {rate} req/s: {args.num_requests} requests")
                results, seconds = asyncio.run(open_loop(url, payloads(i, args.num_requests), rate, seed=i))
                label = f"{mode}, {rate:g}/s"
                numbers, samples[label] = summarize_serve(f"{label}, {lengths}", results, seconds,
                                                          args.output_len)
                points.append((label, numbers))
                if math.isinf(rate) and not eager:
                    all_at_once = (payloads(i, args.num_requests), numbers["output_tok_s"])
            if args.concurrency:
                log(f"closed loop, {args.concurrency} clients: {args.num_requests} requests")
                results, seconds = asyncio.run(closed_loop(url, payloads(1000, args.num_requests),
                                                           args.concurrency))
                label = f"{mode}, c={args.concurrency}"
                numbers, samples[label] = summarize_serve(f"{label}, {lengths}", results, seconds,
                                                          args.output_len)
                points.append((label, numbers))
        finally:
            stop_server(proc)
    plot_serve(points, args.out_dir)
    plot_serve_distribution(samples, args.out_dir)
    plot_burst_ttft({k: v for k, v in samples.items() if k.endswith("inf/s")}, args.out_dir)
    if all_at_once:
        args.enforce_eager = None
        serve_over_offline(args, model_dir, *all_at_once)


def serve_over_offline(args, model_dir, payloads, served_tok_s):
    """The all-at-once requests through LLM.generate (the server is stopped,
    so the device is free): the engine's own speed, which serving should keep."""
    requests = [(p["prompt"], args.output_len) for p in payloads]
    seconds, counts = run_nanoserve(args, model_dir, requests)
    offline_tok_s = sum(counts) / seconds
    report("nanoserve-offline", f"{len(requests)} requests at once, in {args.input_len} "
           f"out {args.output_len}", output_tok_s=offline_tok_s, served_over_offline=served_tok_s / offline_tok_s)


def plot_serve(points, out_dir):
    if not points:
        return
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, title in ((axes[0], "ttft", "time to first token"), (axes[1], "itl", "inter-token latency")):
        for q, style in (("p50", "o-"), ("p99", "s--")):
            ax.plot([p["output_tok_s"] for _, p in points], [p[f"{key}_{q}_ms"] for _, p in points],
                    style, label=q)
        for label, p in points:
            ax.annotate(label, (p["output_tok_s"], p[f"{key}_p50_ms"]), fontsize=7)
        ax.set(xlabel="output tokens/s", ylabel="ms", title=title, yscale="log")
        ax.legend()
    save_plot(fig, out_dir, "serve_latency.png")


def plot_serve_distribution(samples, out_dir):
    """The whole distribution of each setting: the share of first tokens and
    of token gaps at or under each latency (the p99 is where a curve reaches 0.99)."""
    if not samples:
        return
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, key, title in ((axes[0], "ttft", "time to first token"), (axes[1], "itl", "inter-token latency")):
        for label, s in samples.items():
            xs = sorted(v for v in s[key] if v > 0) or [1e-3]
            ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=label)
        ax.axhline(0.99, color="grey", lw=0.5, ls=":")
        ax.set(xscale="log", xlabel="ms", ylabel="share at or under", title=title)
        ax.legend(fontsize=7)
    save_plot(fig, out_dir, "serve_latency_cdf.png")


def plot_burst_ttft(samples, out_dir):
    """Each request's time to first token against the order it was sent in, all at once: a
    scheduler that serves first come first served draws one rising line, a seat shortage a jump."""
    if not samples:
        return
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for label, s in samples.items():
        ax.plot(range(len(s["ttft"])), s["ttft"], ".", ms=3, label=label)
    ax.set(xlabel="request, in the order sent", ylabel="time to first token (ms)",
           title=f"{len(next(iter(samples.values()))['ttft'])} requests at once")
    ax.legend()
    save_plot(fig, out_dir, "serve_burst_ttft.png")


# ---------------------------------------------------------------------------
# Mode: kernel
# The decode attention of one layer at Llama-3.2-1B shapes, over batch x
# context. Block tables are a random permutation of the pool, as after hours
# of serving. GB/s counts only the bytes the answer needs (K and V of every
# context token once, plus q and out), so the three are comparable. On the
# GPU, triton.testing.do_bench flushes the L2 cache before every timed call,
# so even a small batch whose KV fits in L2 is read from memory each time.

N_HEADS, N_KV, HEAD_DIM, BLOCK_SIZE = 32, 8, 64, 16
REF_MAX_BATCH = 32  # the reference loops over sequences in Python: slow past this


def paged_inputs(B, ctx, dtype, device, gen):
    num_blocks_per_seq = -(-ctx // BLOCK_SIZE)
    num_blocks = B * num_blocks_per_seq
    k_cache = torch.randn(num_blocks, BLOCK_SIZE, N_KV, HEAD_DIM, generator=gen, device=device, dtype=dtype)
    v_cache = torch.randn(num_blocks, BLOCK_SIZE, N_KV, HEAD_DIM, generator=gen, device=device, dtype=dtype)
    perm = torch.randperm(num_blocks, generator=gen, device=device)
    block_tables = perm.view(B, num_blocks_per_seq).to(torch.int32)  # (B, max_blocks) shuffled
    context_lens = torch.full((B,), ctx, dtype=torch.int32, device=device)
    q = torch.randn(B, N_HEADS, HEAD_DIM, generator=gen, device=device, dtype=dtype)  # (B, n_heads, hd)
    return q, k_cache, v_cache, block_tables, context_lens


def gather_contiguous(cache, block_tables, ctx):
    """The pool read through the block tables into one (B, n_kv, ctx, hd) tensor."""
    return cache[block_tables.long()].flatten(1, 2)[:, :ctx].transpose(1, 2).contiguous()


def kernel_row(pa, B, ctx, args, timer, run_triton, gen):
    """Seconds per call of each implementation at (B, ctx), the bytes the
    answer needs, and the Triton kernel's largest difference from SDPA."""
    q, k_cache, v_cache, block_tables, context_lens = paged_inputs(B, ctx, args.torch_dtype, args.device, gen)
    k, v = gather_contiguous(k_cache, block_tables, ctx), gather_contiguous(v_cache, block_tables, ctx)
    q4 = q.unsqueeze(2)  # (B, n_heads, 1, hd)
    # enable_gqa: each kv head serves its n_heads // n_kv query heads without copies
    sdpa = lambda: torch.nn.functional.scaled_dot_product_attention(  # noqa: E731
        q4, k, v, scale=HEAD_DIM ** -0.5, enable_gqa=True)
    paged = (q, k_cache, v_cache, block_tables, context_lens, HEAD_DIM ** -0.5)
    seconds = {"sdpa": timer(sdpa)}
    err = float("nan")
    if run_triton:
        seconds["triton"] = timer(lambda: pa.paged_attention_decode(*paged))
        err = (pa.paged_attention_decode(*paged).float() - sdpa().squeeze(2).float()).abs().max().item()
    if B <= REF_MAX_BATCH:
        seconds["ref"] = timer(lambda: pa.paged_attention_decode_ref(*paged), slow=True)
    needed = (k.numel() + v.numel() + 2 * q.numel()) * args.torch_dtype.itemsize  # K, V, q and out
    return seconds, needed, err


def kernel(args, model_dir, hw):
    """The paged decode-attention kernel against SDPA, over batch x context."""
    try:
        import paged_attention as pa
    except ImportError as e:
        log(f"kernel mode skipped: {e}")
        return
    cuda = args.device.startswith("cuda")
    run_triton = cuda or os.environ.get("TRITON_INTERPRET") == "1"
    if not run_triton:
        log("Triton kernel skipped on cpu (set TRITON_INTERPRET=1 to run it in the interpreter)")
    if cuda:
        from triton.testing import do_bench
        timer = lambda fn, slow=False: 1e-3 * do_bench(  # noqa: E731
            fn, warmup=5 if slow else 25, rep=20 if slow else 100, return_mode="median")
    else:
        timer = lambda fn, slow=False: mean_seconds(fn, args.device, 1)  # noqa: E731
    gen = torch.Generator(device=args.device).manual_seed(0)
    print(f"{'B':>4} {'ctx':>5} | {'triton us':>9} {'GB/s':>7} {'%copy':>5} | {'ref us':>9} | "
          f"{'sdpa us':>9} {'GB/s':>7} {'%copy':>5} | {'max err':>7}", flush=True)
    curves = {}
    for B in args.batches:
        for ctx in args.contexts:
            if 2 * B * ctx * N_KV * HEAD_DIM * args.torch_dtype.itemsize > args.kv_cap_gb * 1e9:
                continue
            seconds, needed, err = kernel_row(pa, B, ctx, args, timer, run_triton, gen)
            for name, t in seconds.items():
                gbps = needed / t / 1e9
                record(name, f"B={B} ctx={ctx}", us=1e6 * t, gb_s=gbps, pct_copy=100 * gbps / hw["copy_GB_s"],
                       **({"max_err": err} if name == "triton" else {}))
                curves.setdefault((name, B), {})[ctx] = gbps
            ref = f"{1e6 * seconds['ref']:>9.1f}" if "ref" in seconds else f"{'-':>9}"
            print(f"{B:>4} {ctx:>5} | {_cell(seconds.get('triton'), needed, hw)} | {ref} | "
                  f"{_cell(seconds['sdpa'], needed, hw)} | {err:>7.1e}", flush=True)
    free_memory()
    print(f"max err: largest |triton - SDPA| of the output; GB/s: K, V, q and out bytes / time; "
          f"%copy: of the measured {hw['copy_GB_s']:.0f} GB/s copy bandwidth")
    plot_kernel(curves, hw, args.out_dir)


def _cell(seconds, nbytes, hw):
    if seconds is None:
        return f"{'-':>9} {'-':>7} {'-':>5}"
    gbps = nbytes / seconds / 1e9
    return f"{1e6 * seconds:>9.1f} {gbps:>7.1f} {100 * gbps / hw['copy_GB_s']:>5.1f}"


def plot_kernel(curves, hw, out_dir):
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5), sharey=True)
    batches = sorted({B for _, B in curves})
    colors = dict(zip(batches, plt.cm.viridis([i / max(1, len(batches) - 1) for i in range(len(batches))])))
    contexts = {ctx for c in curves.values() for ctx in c}
    panels = ((axes[0], "triton", "Triton, paged K/V"), (axes[1], "sdpa", "SDPA, contiguous K/V"))
    for ax, name, title in panels:
        for B in batches:
            if (name, B) in curves:
                c = curves[(name, B)]
                ax.plot(list(c), list(c.values()), marker="o", ms=3, color=colors[B], label=f"B={B}")
        ax.axhline(hw["copy_GB_s"], color="gray", lw=1, ls="--", label="copy bandwidth")
        log2_xaxis(ax, contexts)
        ax.set(xlabel="context tokens", title=f"Decode attention: {title}")
        ax.legend(fontsize=7)
    axes[0].set_ylabel("GB/s (K, V, q and out bytes / time)")
    save_plot(fig, out_dir, "kernel.png")


# ---------------------------------------------------------------------------
# Mode: structured
# Offline throughput with a share of the requests constrained to a JSON schema
# (none, a tenth, all), or to tool_choice "auto"'s grammar (free text, strict
# from <tool_call> on: the random prompts never get there, so this is what a
# free row under a lazy grammar costs), greedy with EOS ignored by free rows:
# what the grammars cost the whole batch. The schema asks for exactly 24
# strings, so that a random model cannot close its JSON early. The host's time
# per step is split in two, each per step with a constrained row and per such
# row: mask_* (ModelRunner.token_masks: the bitmasks of what may come next)
# and commit_* (EngineCore._commit past its wait for the tokens: the matchers
# follow the tokens, and the end checks).
# The grammar needs a real tokenizer: --tokenizer gives a random model its
# tokenizer and vocabulary (the embedding cut to the tokenizer's rows, so that
# no row can pick an id the grammar cannot see).

LIST_SCHEMA = {"type": "object", "additionalProperties": False, "required": ["items"],
               "properties": {"items": {"type": "array", "minItems": 24, "maxItems": 24,
                                        "items": {"type": "string", "maxLength": 12}}}}


def host_timers(llm):
    """Wrap the grammar masks' fill and _commit with timers; return their totals: [steps, rows,
    seconds]."""
    engine, totals = llm.engine, {"mask": [0, 0, 0.0], "commit": [0, 0, 0.0]}
    commit = engine._commit

    def add(name, rows, seconds):
        t = totals[name]
        t[0], t[1], t[2] = t[0] + 1, t[1] + rows, t[2] + seconds

    if hasattr(engine.runner, "grammar_masks"):   # the fill itself, on its thread: llguidance's
        import llguidance.numpy
        fill = llguidance.numpy.fill_next_token_bitmask_par

        def timed_fill(executor, pairs, bitmask):
            start = time.perf_counter()
            fill(executor, pairs, bitmask)
            add("mask", len(pairs), time.perf_counter() - start)
        llguidance.numpy.fill_next_token_bitmask_par = timed_fill
    else:                                          # older versions: token_masks(seqs) in the loop
        token_masks = engine.runner.token_masks

        def timed_masks(seqs):
            start, out = time.perf_counter(), token_masks(seqs)
            if out is not None:
                add("mask", len(out[0]), time.perf_counter() - start)
            return out
        engine.runner.token_masks = timed_masks

    def timed_commit(step):
        getattr(engine.runner, "finish_sample", lambda step: None)(step)   # sampled, if not yet
        if step.copied is not None:
            step.copied.synchronize()          # the wait for the device is not the host's work
        start, out = time.perf_counter(), commit(step)
        rows = sum(s.matcher is not None for s in step.seqs)
        if rows:
            add("commit", rows, time.perf_counter() - start)
        return out
    engine._commit = timed_commit
    return totals


def structured(args, model_dir, hw):
    """Throughput with 0%, 10% and 100% of the requests constrained to a JSON schema, and
    with 10% and 100% under tool_choice "auto"'s grammar."""
    from nanoserve import SamplingParams, tool_call_grammar
    llm = make_llm(args, model_dir)
    grammar = llm.front.grammar(json.dumps(LIST_SCHEMA))
    tool = {"type": "function", "function": {"name": "list", "parameters": LIST_SCHEMA}}
    auto = llm.front.grammar(tool_call_grammar("hermes", [tool], "auto", True), True)
    totals = host_timers(llm)
    rng = random.Random(0)
    vocab = min(llm.engine.cfg.vocab_size, llm.front.tokenizer.get_vocab_size())
    prompts = random_prompts(rng, vocab, [rng.randint(args.min_input, args.max_input)
                                          for _ in range(args.num_seqs)])
    settings = [("JSON schema", s, grammar) for s in args.shares if s] + \
        [("tool_choice auto", s, auto) for s in args.auto_shares if s]
    base = None
    for kind, share, g in [("none", 0.0, None)] + settings:
        num = round(share * len(prompts))
        params = [SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=i >= num,
                                 grammar=g if i < num else None) for i in range(len(prompts))]
        llm.generate(prompts, [dataclasses.replace(p, max_tokens=4) for p in params])  # warm-up
        for t in totals.values():
            t[:] = [0, 0, 0.0]
        seconds, outs = timed(lambda: llm.generate(prompts, params), args.device)
        tokens = sum(len(o.token_ids) for o in outs)
        base = base or tokens / seconds
        (mask_steps, mask_rows, mask_s), (commit_steps, commit_rows, commit_s) = \
            totals["mask"], totals["commit"]
        report("nanoserve", f"{share:.0%} of {len(prompts)}, {kind}", output_tok_s=tokens / seconds,
               vs_none=tokens / seconds / base, mean_output_len=tokens / len(prompts),
               mask_ms_per_step=1e3 * mask_s / max(1, mask_steps),
               mask_us_per_row=1e6 * mask_s / max(1, mask_rows),
               commit_ms_per_step=1e3 * commit_s / max(1, commit_steps),
               commit_us_per_row=1e6 * commit_s / max(1, commit_rows))


# ---------------------------------------------------------------------------
# Mode: prefix
# Requests that share one long prefix (a system prompt, few-shot examples).
# With prefix caching, the prefix's KV blocks are computed once and shared.
# "first call": all requests in one generate call on a fresh engine, so only
# requests scheduled after the first prefix blocks are cached can reuse them.
# "second call": the same prefix with new suffixes in a later call, when the
# prefix is already in the cache. TTFT = arrival -> first token.


def prefix_calls(args, model_dir, caching, calls, rng, vocab):
    """Report both calls on one fresh engine; return their mean TTFTs (ms)."""
    llm = make_llm(args, model_dir, enable_prefix_caching=caching)
    # warm-up at the measured shapes, with unrelated prompts that share nothing
    lengths = [args.prefix_len + args.suffix_len] * args.num_requests
    nanoserve_generate(llm, random_prompts(rng, vocab, lengths), args.output_len)
    means = {}
    for call, prompts in zip(("first call", "second call"), calls):
        seconds, outs = timed(lambda: nanoserve_generate(llm, prompts, args.output_len), args.device)
        ttft = [1e3 * (o.first_token_time - o.arrival_time) for o in outs]
        cached = sum(o.num_cached_tokens for o in outs) / sum(len(p) for p in prompts)
        setting = f"caching {'on' if caching else 'off'}, {call}"
        report("nanoserve", setting, ttft_mean_ms=statistics.mean(ttft), ttft_p50_ms=percentile(ttft, 50),
               output_tok_s=sum(len(o.token_ids) for o in outs) / seconds, seconds=seconds,
               cached_pct=100 * cached)
        means[setting] = statistics.mean(ttft)
    return means


def prefix(args, model_dir, hw):
    """Requests sharing a long prefix, prefix caching on and off."""
    vocab = model_shape(model_dir, args.torch_dtype).vocab_size
    rng = random.Random(0)
    shared = random_prompts(rng, vocab, [args.prefix_len])[0]
    calls = [[shared + s for s in random_prompts(rng, vocab, [args.suffix_len] * args.num_requests)]
             for _ in range(2)]
    ttft_means = {}
    for caching in (True, False):
        try:
            ttft_means.update(prefix_calls(args, model_dir, caching, calls, rng, vocab))
        except Exception:
            traceback.print_exc()
            log(f"nanoserve with prefix caching {'on' if caching else 'off'} FAILED, skipped")
        free_memory()
    plot_bars(ttft_means, "mean TTFT (ms)", f"{args.num_requests} requests sharing a "
              f"{args.prefix_len}-token prefix", args.out_dir, "prefix.png")


# ---------------------------------------------------------------------------
# spec: speculative decoding with prompt-lookup drafts
# On the CPU, the real model and one sequence on four tasks, nanoserve with and
# without drafts next to transformers' generate with and without
# prompt_lookup_num_tokens, each turn of the four in a row (so load moves them
# alike), the best turn counting. On a GPU, random weights (they rarely repeat
# their prompt, so this measures the mechanism): what a verify step costs
# against a decode step by batch size, with a kernel breakdown at batch 1;
# offline throughput with drafts on and off, taking turns in one engine; and
# bf16 agreement, speculative against plain and plain alone against batched.

PASSAGE = ("The lighthouse at Kerrow Point was built in 1871 by the engineer Thomas Stevenson. Its "
           "light could be seen from twenty-two miles at sea, and for ninety years three keepers "
           "lived in the cottages below it, trimming the wick every four hours through the night. "
           "In 1962 the light was automated, the keepers left, and the cottages became a small "
           "museum of charts, lamps and the logbooks the keepers wrote every evening.")
CODE = ("def summarize(records):\n    count = 0\n    total = 0.0\n    for record in records:\n"
        "        if record.valid:\n            count += 1\n            total += record.amount\n"
        "    average = total / count if count else 0.0\n    return count, total, average\n")
SPEC_TASKS = {
    "copy a passage": "Copy the following passage exactly, word for word:\n\n" + PASSAGE,
    "rename in code": "Rename the variable `total` to `amount_sum` in this Python function and "
                      "write out the whole function:\n\n" + CODE,
    "answer from a document": "Document:\n" + PASSAGE + "\n\nQuestion: what does the document say "
                              "about the keepers? Answer by quoting, word for word, every "
                              "sentence of the document that mentions them.",
    "open-ended writing": "Write a short story about a robot who learns to paint.",
}


def spec_cpu(args, model_dir):
    """One sequence per task, greedy: tok/s of each system, the speedup over its own plain
    decoding, nanoserve's tokens per step and acceptance rate; a PNG of the speedups."""
    from nanoserve import SamplingParams
    k = args.num_speculative_tokens
    llm = make_llm(args, model_dir, num_threads=args.num_threads)   # sets torch's, HF's too
    hf = load_hf_model(model_dir, args)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len)
    front, stats = llm.front, llm.engine.scheduler
    tasks = list(SPEC_TASKS.items())[:args.num_tasks]
    ids = {task: front.encode(front.chat_template.render([{"role": "user", "content": text}]),
                              add_special_tokens=False) for task, text in tasks}

    def one_nanoserve(prompt, drafts):
        llm.engine.cfg.num_speculative_tokens = drafts     # the scheduler reads it every step
        spec = stats.speculation
        steps, drafted, accepted = stats.num_steps, spec.num_draft_tokens, spec.num_accepted_tokens
        seconds, out = timed(lambda: llm.generate([prompt], params)[0], "cpu")
        return seconds, len(out.token_ids), dict(
            steps=stats.num_steps - steps - 1,            # the prompt's step is not a decode
            drafted=spec.num_draft_tokens - drafted, accepted=spec.num_accepted_tokens - accepted)

    def one_hf(prompt, drafts):
        extra = {"prompt_lookup_num_tokens": drafts} if drafts else {}
        with torch.no_grad():
            seconds, out = timed(lambda: hf.generate(
                torch.tensor([prompt]), max_new_tokens=args.output_len, do_sample=False,
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long), **extra), "cpu")
        return seconds, out.shape[1] - len(prompt), {}

    systems = {"nanoserve": (one_nanoserve, 0), f"nanoserve k={k}": (one_nanoserve, k),
               "transformers generate": (one_hf, 0),
               f"transformers prompt lookup k={k}": (one_hf, k)}
    speedups = {}
    for task, _ in tasks:
        best = {}
        for name, (fn, drafts) in systems.items():
            fn(ids[task][:32], drafts)                    # warm-up
        for _ in range(args.repeats):                     # turns: each system once in a row
            for name, (fn, drafts) in systems.items():
                seconds, n, more = fn(ids[task], drafts)
                if name not in best or seconds < best[name][0]:
                    best[name] = (seconds, n, more)
        for name, (seconds, n, more) in best.items():
            plain = best["nanoserve" if name.startswith("nanoserve") else "transformers generate"]
            speedup = (n / seconds) / (plain[1] / plain[0])
            numbers = dict(tok_s=n / seconds, speedup=speedup, tokens=n)
            if more.get("steps"):
                numbers.update(tokens_per_step=n / (more["steps"] + 1),
                               acceptance=more["accepted"] / max(1, more["drafted"]))
            report(name, task, **numbers)
            speedups.setdefault(name, {})[task] = speedup
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / len(speedups)
    for i, (name, by_task) in enumerate(speedups.items()):
        ax.bar([j + i * width for j in range(len(by_task))], list(by_task.values()), width, label=name)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(tasks))], [t for t, _ in tasks])
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_ylabel("speed over its own plain decoding")
    ax.set_title(f"one sequence, greedy, CPU, {model_dir.name}")
    ax.legend(fontsize=8)
    save_plot(fig, args.out_dir, "spec.png")


def spec(args, model_dir, hw):
    """Speculative decoding: CPU one-sequence tasks against transformers' prompt lookup, or GPU
    verify-step cost, offline throughput on and off, and bf16 agreement."""
    if args.device.startswith("cuda"):
        spec_gpu(args, model_dir)
    else:
        spec_cpu(args, model_dir)


def _verify_step_seconds(llm, B, ctx, k, iters=20):
    """Mean seconds of one step of B rows, each a decode (k = 0) or a decode with k drafts,
    through the engine's runner (graphs, sampling, the read-back), at context ctx."""
    import nanoserve as ns
    engine, bs = llm.engine, llm.engine.cfg.block_size
    seqs = []
    for i in range(B):
        seq = engine.sequence_class(f"v{i}", [(7 * i + j) % 1000 + 1 for j in range(ctx)],
                                    ns.SamplingParams(temperature=0))
        seq.block_table = [engine.allocator.allocate() for _ in range(-(-(ctx + k) // bs))]
        seq.num_computed_tokens = ctx - 1
        seqs.append(seq)

    def step():
        drafts = {seq: list(range(1, k + 1)) for seq in seqs} if k else {}
        batch = ns.ScheduledBatch(seqs, [1 + k] * B)
        batch.draft_token_ids = drafts                # as SpeculativeScheduler.schedule sets it
        launched = engine.runner.launch(batch)
        engine.runner.sample(launched)
        engine.runner.finish_sample(launched)
        return launched.tokens.tolist()
    seconds = mean_seconds(step, engine.cfg.device, iters)
    for seq in seqs:
        for block in seq.block_table:
            engine.allocator.free(block)
    return seconds


def _loop_step_seconds(llm, ctx, k, new_tokens=128):
    """Mean seconds of one engine step at batch 1 in the step loop (the one-ahead overlap as the
    engine runs it): a ctx-token prompt, then new_tokens greedy tokens, each step drafting k
    tokens (repeats of the newest, which a random model rejects) or none."""
    import nanoserve as ns
    engine, propose = llm.engine, ns.NgramIndex.propose
    prompt = [(13 * j) % min(5000, engine.cfg.vocab_size - 7) + 7 for j in range(ctx)]
    ns.NgramIndex.propose = lambda self, token_ids, n: [token_ids[-1]] * n
    engine.cfg.num_speculative_tokens, k0 = k, engine.cfg.num_speculative_tokens
    try:
        best = math.inf
        for _ in range(3):
            steps = engine.scheduler.num_steps
            seconds, _ = timed(lambda: nanoserve_generate(llm, [prompt], new_tokens), engine.cfg.device)
            best = min(best, seconds / (engine.scheduler.num_steps - steps - 1))  # less the prompt's
    finally:
        ns.NgramIndex.propose, engine.cfg.num_speculative_tokens = propose, k0
    return best


def _kernel_times(llm, B, k, ctx):
    """Device time per kernel group of one step (decode or verify) at batch B, microseconds."""
    from torch.profiler import ProfilerActivity, profile
    _verify_step_seconds(llm, B, ctx, k, iters=2)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        _verify_step_seconds(llm, B, ctx, k, iters=10)
    groups = {}
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        n = e.name.lower()
        group = ("GEMV" if "gemv" in n else "attention" if "decode" in n or "prefill" in n
                 else "skinny" if "skinny" in n else "matmul (cuBLAS)" if any(w in n for w in ("gemm", "sm90", "cutlass", "xmma", "nvjet", "splitk"))
                 else "RoPE-store" if "rope" in n else "norm, silu, add" if any(w in n for w in (
                     "rms_norm", "silu", "add", "elementwise")) else "other")
        groups[group] = groups.get(group, 0.0) + (e.time_range.end - e.time_range.start) / 11
    return groups      # 11 steps: mean_seconds' warm-up call, then 10


def spec_gpu(args, model_dir):
    import nanoserve as ns
    k = args.num_speculative_tokens
    llm = make_llm(args, model_dir, num_speculative_tokens=k)
    shape = model_shape(model_dir, args.torch_dtype)
    rng = random.Random(0)
    nanoserve_generate(llm, random_prompts(rng, shape.vocab_size, [32, 48]), 8)  # warm-up
    # -- verify-step cost by batch size --
    for B in args.batch_sizes:
        for drafts in sorted({1, 2, k} if B == 1 else {k}):
            pairs = [(_verify_step_seconds(llm, B, args.context, 0),
                      _verify_step_seconds(llm, B, args.context, drafts)) for _ in range(2)]
            decode, verify = min(p[0] for p in pairs), min(p[1] for p in pairs)
            report("nanoserve", f"verify step B={B} k={drafts} ctx={args.context}",
                   decode_ms=1e3 * decode, verify_ms=1e3 * verify, ratio=verify / decode)
    # -- in the step loop at batch 1: every step drafts k tokens that the model rejects --
    for turn in range(2):
        off, on = _loop_step_seconds(llm, args.context, 0), _loop_step_seconds(llm, args.context, k)
        report("nanoserve", f"step loop B=1 k={k} ctx={args.context} turn {turn}",
               decode_ms=1e3 * off, verify_ms=1e3 * on, ratio=on / off)
    for drafts in (0, k):
        groups = _kernel_times(llm, 1, drafts, args.context)
        log(f"batch 1, {'decode' if drafts == 0 else f'verify k={drafts}'} step, device us by kernel: "
            + ", ".join(f"{g} {us:.0f}" for g, us in sorted(groups.items(), key=lambda x: -x[1]))
            + f"; total {sum(groups.values()):.0f}")
    # -- offline throughput, drafts on and off taking turns in one engine --
    inputs = (100, 1024) if args.device.startswith("cuda") else (8, 32)   # throughput's sizes
    lengths = [(rng.randint(*inputs), rng.randint(min(100, args.max_output), args.max_output))
               for _ in range(args.num_seqs)]
    prompts = random_prompts(rng, shape.vocab_size, [n for n, _ in lengths])
    nanoserve_generate(llm, prompts[:32], 32)                     # warm-up at a larger batch
    rates = {0: [], k: []}
    for turn in range(args.repeats):
        for drafts in ((0, k) if turn % 2 == 0 else (k, 0)):
            llm.engine.cfg.num_speculative_tokens = drafts
            before = llm.engine.scheduler.speculation.num_draft_tokens
            seconds, outs = timed(lambda: nanoserve_generate(llm, prompts, [n for _, n in lengths]), args.device)
            rates[drafts].append(sum(len(o.token_ids) for o in outs) / seconds)
            log(f"  offline turn {turn} drafts {drafts}: {rates[drafts][-1]:.0f} tok/s, "
                f"{llm.engine.scheduler.speculation.num_draft_tokens - before} tokens drafted")
    report("nanoserve", f"offline {args.num_seqs} seqs, drafts off", tok_s=statistics.mean(rates[0]))
    report("nanoserve", f"offline {args.num_seqs} seqs, k={k}", tok_s=statistics.mean(rates[k]),
           vs_off=statistics.mean(rates[k]) / statistics.mean(rates[0]))
    # -- concurrency below and above the rule's crossover, the rule lifted --
    limit, ns.Speculation.SPECULATE_MAX_ROWS = ns.Speculation.SPECULATE_MAX_ROWS, 10 ** 6
    for B in args.concurrency:
        base = random_prompts(rng, shape.vocab_size, [64] * B)
        batch = [p + p[:32] for p in base]           # each repeats itself: drafts to check
        tok_s = {}
        for drafts in (0, k, 0, k):
            llm.engine.cfg.num_speculative_tokens = drafts
            s0 = llm.engine.scheduler.speculation
            d0, a0 = s0.num_draft_tokens, s0.num_accepted_tokens
            seconds, outs = timed(lambda: nanoserve_generate(llm, batch, args.output_len), args.device)
            tok_s[drafts] = max(tok_s.get(drafts, 0), sum(len(o.token_ids) for o in outs) / seconds)
            if drafts:
                acceptance = (s0.num_accepted_tokens - a0) / max(1, s0.num_draft_tokens - d0)
        report("nanoserve", f"B={B} at once, rule lifted", off_tok_s=tok_s[0], on_tok_s=tok_s[k],
               on_vs_off=tok_s[k] / tok_s[0], acceptance=acceptance)
    ns.Speculation.SPECULATE_MAX_ROWS = limit
    # -- bf16 agreement: speculative against plain, plain alone against plain batched --
    base = random_prompts(rng, shape.vocab_size, [48] * args.agreement_prompts)
    prompts = [p + p[:24] for p in base]
    runs = {}
    for name, drafts, together in (("plain alone", 0, False), ("plain batched", 0, True),
                                   ("speculative alone", k, False)):
        llm.engine.cfg.num_speculative_tokens = drafts
        outs = (nanoserve_generate(llm, prompts, args.output_len) if together else
                [nanoserve_generate(llm, [p], args.output_len)[0] for p in prompts])
        runs[name] = [o.token_ids for o in outs]
    for name in ("speculative alone", "plain batched"):
        same = [a == b for a, b in zip(runs[name], runs["plain alone"])]
        first = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
                 for a, b in zip(runs[name], runs["plain alone"])]
        report("nanoserve", f"{args.dtype} {name} vs plain alone", identical=f"{sum(same)}/{len(same)}",
               mean_first_difference=statistics.mean(first), tokens=args.output_len)


# ---------------------------------------------------------------------------
# CLI
# One subcommand per mode. Sizes left unset get a GPU default or a small CPU
# default, so every mode also runs as a quick smoke test on a CPU.


def int_list(s):
    return [int(x) for x in s.split(",")]


# -- tp: tensor parallelism, TP=1 against TP=N --
# torch.distributed's group belongs to the process, so each engine runs in a child process
# (`bench.py tp --part offline|serve --tensor-parallel-size N`) that prints one line
# "RESULT {json}" per figure; the parent runs the children in turn and prints the table.

def _tp_result(args, **numbers):
    print("RESULT " + json.dumps({"tp": args.tensor_parallel_size or 1, **numbers}), flush=True)


def _tp_offline(args, model_dir):
    """Batch-1 decode (best of two, and the GB/s one rank reads a step), then offline throughput."""
    shape, rng = model_shape(model_dir, args.torch_dtype), random.Random(0)
    llm = make_llm(args, model_dir)
    nanoserve_generate(llm, random_prompts(rng, shape.vocab_size, [32, 48]), 8)  # warm-up
    prompt = random_prompts(random.Random(1), shape.vocab_size, [128])
    tok_s = []
    for _ in range(2):
        o = nanoserve_generate(llm, prompt, args.decode_len)[0]
        tok_s.append((len(o.token_ids) - 1) / (o.finish_time - o.first_token_time))
    _tp_result(args, what="decode B=1 tok/s", value=max(tok_s), tokens=o.token_ids[:64])
    tp, ctx = args.tensor_parallel_size or 1, 128 + args.decode_len / 2
    step_bytes = ((shape.num_layer_params / tp + shape.vocab_size * shape.hidden_size) * shape.dtype_bytes
                  + ctx * shape.kv_bytes_per_token / tp)   # a rank's layers, the whole LM head
    _tp_result(args, what="decode B=1 GB/s read per GPU (weights + KV)", value=step_bytes * max(tok_s) / 1e9)
    least = min(100, args.max_output)
    lengths = [(rng.randint(100, 1024), rng.randint(least, args.max_output)) for _ in range(args.num_seqs)]
    prompts = random_prompts(rng, shape.vocab_size, [n for n, _ in lengths])
    seconds, outs = timed(lambda: nanoserve_generate(llm, prompts, [n for _, n in lengths]), args.device)
    _tp_result(args, what=f"offline {len(prompts)} seqs in 100-1024 out {least}-{args.max_output}, "
               "output tok/s", value=sum(len(o.token_ids) for o in outs) / seconds)


def _tp_serve(args, model_dir):
    """The server at each rate (inf: every request at once), greedy, streamed."""
    shape = model_shape(model_dir, args.torch_dtype)
    log_path = Path(args.out_dir) / f"serve_tp{args.tensor_parallel_size or 1}.log"
    proc, url = start_server(args, model_dir, log_path)
    try:
        name = wait_healthy(proc, url, log_path, 300)

        def payloads(seed, n):
            return [{"model": name, "prompt": p, "max_tokens": args.output_len, "temperature": 0.0,
                     "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
                    for p in random_prompts(random.Random(seed), shape.vocab_size, [args.input_len] * n)]
        asyncio.run(closed_loop(url, payloads(10_000, 4), 2))  # warm-up
        for i, rate in enumerate(args.rates):
            results, seconds = asyncio.run(open_loop(url, payloads(i, args.num_requests), rate, i))
            numbers, _ = summarize_serve(f"tp {args.tensor_parallel_size or 1} rate {rate}", results,
                                         seconds, args.output_len)
            _tp_result(args, what=f"serve {rate:g}/s", **numbers)
    finally:
        stop_server(proc)


def tensor_parallel(args, model_dir, hw):
    """Tensor parallelism: TP=1 against TP=N, batch-1 decode, offline and served, in turns."""
    if args.part:                     # a child: one engine, one part
        return {"offline": _tp_offline, "serve": _tp_serve}[args.part](args, model_dir)
    rows, failed = {}, []             # what -> {tp: numbers}; the children that failed
    for part in ("offline", "serve"):
        for n in args.tp_sizes:
            cmd = [sys.executable, str(REPO_DIR / "bench.py"), *sys.argv[1:], "--part", part,
                   "--tensor-parallel-size", str(n), "--model", str(model_dir)]
            log(f"{part}, tensor_parallel_size {n}")
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.part_timeout)
            for line in done.stdout.splitlines():
                if line.startswith("RESULT "):
                    r = json.loads(line[7:])
                    rows.setdefault(r["what"], {})[r["tp"]] = r
            if done.returncode:
                log(f"{part} at TP={n} exited with {done.returncode}:\n{done.stderr[-2000:]}")
                failed.append(f"{part} at TP={n}")
    base = args.tp_sizes[0]
    print(f"\n{'setting':<58} " + " ".join(f"{'TP=%d' % n:>9}" for n in args.tp_sizes) + f" {'ratio':>7}")
    for what, by_tp in rows.items():
        keys = ["value"] if "value" in next(iter(by_tp.values())) else \
            ["output_tok_s", "ttft_p50_ms", "tpot_p50_ms", "itl_p99_ms", "num_failed"]
        for k in keys:
            values = [by_tp.get(n, {}).get(k) for n in args.tp_sizes]
            ratio = f"{values[-1] / values[0]:7.2f}" if values[0] and values[-1] else ""
            cells = " ".join(f"{'-' if v is None else round(v, 1)!s:>9}" for v in values)
            print(f"{what if k == 'value' else f'{what}: {k}':<58} {cells} {ratio}")
    decode = rows.get("decode B=1 tok/s", {})
    first = [decode.get(n, {}).get("tokens") for n in (base, args.tp_sizes[-1])]
    if all(first):
        same = next((i for i, (x, y) in enumerate(zip(*first)) if x != y), len(first[0]))
        print(f"batch-1 greedy tokens: TP={args.tp_sizes[-1]} equals TP={base} for the first {same} "
              f"of {len(first[0])} (in bf16 the sums' order differs, and a tie may fall either way)")
    plot_bars({f"TP={n}": rows.get(next((w for w in rows if w.startswith("offline")), ""), {})
               .get(n, {}).get("value", 0) for n in args.tp_sizes}, "output tokens/s",
              "Offline throughput by tensor-parallel size", args.out_dir, "tensor_parallel.png")
    if failed:
        raise RuntimeError(f"failed: {', '.join(failed)}")


def rate_list(s):
    return [math.inf if x.strip() in ("inf", "infinity") else float(x) for x in s.split(",")]


# ---------------------------------------------------------------------------
# Mode: host
# Where the host's time goes in a steady decode step, phase by phase, beside
# the device's time for the same step. Each phase is wrapped with a timer; only
# steps whose batch is B decodes count (after the first few). The device's
# time is the B-row decode graph replayed alone. While the host's phases add
# up to more than the device's time, the device waits for the host. With
# --against DIR, DIR's nanoserve.py (on this paged_attention.py) runs beside
# this one in the same process, the two taking turns each round.

HOST_PHASES = (("Scheduler", "schedule"), ("ModelRunner", "prepare"), ("ModelRunner", "launch"),
               ("ModelRunner", "sampling_batch"), ("ModelRunner", "sample"),
               ("EngineCore", "_commit"), ("FrontEnd", "process"), ("EngineCore", "step"))


def host(args, model_dir, hw):
    """Host microseconds per phase of a steady decode step at each batch size,
    and the device's microseconds for the same step's CUDA graph (GPU)."""
    import nanoserve
    vocab = model_shape(model_dir, args.torch_dtype).vocab_size
    modules = [("this", nanoserve)]
    if args.against:
        spec = importlib.util.spec_from_file_location("nanoserve_against",
                                                      Path(args.against) / "nanoserve.py")
        modules.append((args.against, importlib.util.module_from_spec(spec)))
        sys.modules[spec.name] = modules[-1][1]              # dataclasses look it up
        spec.loader.exec_module(modules[-1][1])
    # two engines share the device: each gets the blocks its rows need, not a share of memory
    blocks = max(args.batch_sizes) * -(-(args.prompt_len + args.decode_len) // 16) + 64
    sizes = dict(num_blocks=blocks, max_num_seqs=max(args.batch_sizes)) if args.against else {}
    engines = [(label, ns, make_llm(args, model_dir, ns=ns, **sizes), host_timers_of(ns))
               for label, ns in modules]
    rng = random.Random(0)
    for label, ns, llm, _ in engines:
        nanoserve_generate(llm, random_prompts(rng, vocab, [args.prompt_len] * 8), 8, ns)  # warm
    plotted = []                                         # (label, B, its medians) for the plot
    for B in args.batch_sizes:
        prompts = random_prompts(rng, vocab, [args.prompt_len] * B)
        runs = {label: [] for label, *_ in engines}          # per round: {phase: us a step}
        for r in range(args.rounds):
            for label, ns, llm, (totals, steps) in engines[::1 if r % 2 == 0 else -1]:
                totals.clear()
                steps.update(B=B, n=0)
                nanoserve_generate(llm, prompts, args.decode_len, ns)
                n = max(1, steps["n"] - 8)
                runs[label].append({k: 1e6 * v / n for k, v in totals.items()})
        for label, ns, llm, _ in engines:
            median = {k: statistics.median(r[k] for r in runs[label]) for k in runs[label][0]}
            median["device"] = graph_us(llm.engine.runner, B, args.device)
            plotted.append((label, B, median))
            report(f"nanoserve ({label})", f"host per decode step, B={B}",
                   device_us=median["device"],
                   **{f"{name}_us": median.get(name, 0.0) for _, name in HOST_PHASES})
    plot_host(plotted, args.out_dir)


def plot_host(rows, out_dir):
    """Each version and batch size's host phases stacked, a step's worth, and the device's time
    for the same step as a black bar across: where the stack rises above it, the device waits."""
    plt = pyplot()
    parts = [("schedule", lambda r: r["schedule"]), ("prepare", lambda r: r["prepare"]),
             ("launch", lambda r: r["launch"] - r["prepare"]), ("sample", lambda r: r["sample"]),
             ("commit", lambda r: r["_commit"]), ("front end", lambda r: r["process"])]
    fig, ax = plt.subplots(figsize=(max(5, 1.3 * len(rows)), 4))
    names, bottom = [f"{label}\nB={B}" for label, B, _ in rows], [0.0] * len(rows)
    for part, height_of in parts:
        heights = [height_of(r) for *_, r in rows]
        ax.bar(names, heights, bottom=bottom, label=part)
        bottom = [b + h for b, h in zip(bottom, heights)]
    device = [(name, r["device"]) for name, (*_, r) in zip(names, rows) if r["device"]]
    if device:
        ax.scatter(*zip(*device), marker="_", s=1500, color="black", label="device (graph alone)")
    ax.set_ylabel("microseconds per decode step")
    ax.set_title("the host's work per phase of a steady decode step", fontsize=10)
    ax.legend(fontsize=8)
    save_plot(fig, out_dir, "host.png")


def host_timers_of(ns):
    """Wrap one nanoserve module's phases with timers; return (totals, steps). steps["n"] counts
    the steady steps of steps["B"] rows; the phases of the ninth and later ones count."""
    totals, steps = {}, {"B": 0, "n": 0, "on": False}

    def timed(fn, name):
        def wrapper(*a, **k):
            start = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                if steps["on"]:
                    totals[name] = totals.get(name, 0.0) + time.perf_counter() - start
        return wrapper
    def engine_class(name):     # the default engine's class (each chapter's methods in turn)
        return getattr(ns, {"Scheduler": "DefaultScheduler", "ModelRunner": "DefaultRunner",
                            "EngineCore": "DefaultEngineCore"}.get(name, name), None) \
            or getattr(ns, name)              # a version before the default engine's classes
    for cls, name in HOST_PHASES:
        setattr(engine_class(cls), name, timed(getattr(engine_class(cls), name), name))
    step = engine_class("EngineCore").step

    def counted_step(self):
        s = self.scheduler
        steady = len(s.running) == steps["B"] and not s.waiting and all(
            q.num_computed_tokens >= q.num_prompt_tokens for q in s.running)
        steps["n"] += steady
        steps["on"] = steady and steps["n"] > 8    # until the next step: the front end's turn too
        return step(self)
    engine_class("EngineCore").step = counted_step
    return totals, steps


def graph_us(runner, B, device, reps=50):
    """Microseconds of the B-row decode graph replayed alone (its inputs as the last step left
    them); None without one."""
    import paged_attention as pa
    key = pa.graph_key(runner.graph_sizes, True, B)
    if not device.startswith("cuda") or key not in runner.graphs:
        return None
    graph = runner.graphs[key][0]
    graph.replay()
    seconds, _ = timed(lambda: [graph.replay() for _ in range(reps)], device)
    return 1e6 * seconds / reps


# ---------------------------------------------------------------------------
# Mode: model
# No benchmark: the random model's folder, built as every mode builds it, for
# `nanoserve.py serve --model DIR`. With --tokenizer weights/SmolLM2-135M-Instruct
# it has a real tokenizer and a chat template in the family's own format
# (CHAT_TEMPLATES), so chat and each family's tool calls can be tried with no
# download (the answers are noise).

def model(args, model_dir, hw):
    """Build a random model's folder (--random, and --tokenizer for a real tokenizer, with the
    family's chat template) and print its path as the last line, for nanoserve.py serve --model."""
    print(model_dir.resolve())


MODES = {"throughput": throughput, "latency": latency, "serve": serve, "kernel": kernel, "prefix": prefix,
         "structured": structured, "tp": tensor_parallel, "spec": spec, "host": host, "model": model}

# Sizes of each mode: (flag, type, GPU default, CPU default, help).
SIZE_FLAGS = {
    "throughput": [
        ("num_seqs", int, 256, 8, "requests"),
        ("min_input", int, 100, 8, "shortest prompt"), ("max_input", int, 1024, 32, "longest prompt"),
        ("min_output", int, 100, 4, "fewest output tokens"),
        ("max_output", int, 1024, 16, "most output tokens"),
        ("hf_batch_size", int, 64, 4, "static batch of transformers-generate"),
        ("hf_num_seqs", int, None, None, "transformers runs on the first N requests only (default: all)")],
    "latency": [
        ("prompt_len", int, 128, 16, "prompt of the decode settings"),
        ("decode_len", int, 256, 128, "new tokens of the batch-1 decode and the cpu one-sequence request"),
        ("batch_decode_len", int, 128, 8, "new tokens of each batch-size setting"),
        ("prefill_lens", int_list, [128, 512, 2048, 8192], [16, 64, 256], "prompt lengths of the prefill"),
        ("batch_sizes", int_list, [1, 8, 32, 128, 256], [1, 4, 8], "batches of the decode scaling"),
        ("long_prompt_len", int, 2000, 2000, "prompt of the long-prompt request (cpu only)"),
        ("long_decode_len", int, 32, 32, "new tokens of the long-prompt request (cpu only)"),
        ("repeats", int, 3, 3, "turns of each cpu request; the best counts (cpu only)")],
    "serve": [
        ("rates", rate_list, [32.0, math.inf], [8.0, math.inf],
         "requests/s, comma-separated; inf sends all at once (and runs them offline too)"),
        ("num_requests", int, 400, 6, "requests per setting"),
        ("input_len", int, 1024, 16, "prompt tokens"), ("output_len", int, 128, 8, "output tokens"),
        ("concurrency", int, 0, 4, "clients of the closed-loop setting (0: none)"),
        ("startup_timeout", float, 600.0, 600.0, "seconds to wait for /health")],
    "kernel": [
        ("batches", int_list, [1, 4, 16, 32, 64, 128, 256], [1, 2], "batch sizes"),
        ("contexts", int_list, [128, 512, 1024, 2048, 4096, 8192], [32, 64], "context lengths"),
        ("kv_cap_gb", float, 8.0, 8.0, "skip settings whose K and V exceed this")],
    "prefix": [
        ("num_requests", int, 64, 8, "requests sharing the prefix"),
        ("prefix_len", int, 1024, 256, "shared prefix tokens"),
        ("suffix_len", int, 32, 16, "tokens of each request's own suffix"),
        ("output_len", int, 32, 8, "output tokens")],
    "structured": [
        ("num_seqs", int, 256, 16, "requests"),
        ("min_input", int, 100, 8, "shortest prompt"), ("max_input", int, 1024, 32, "longest prompt"),
        ("output_len", int, 256, 16, "most output tokens (a grammar may end a request sooner)"),
        ("shares", lambda s: [float(x) for x in s.split(",")], [0.0, 0.1, 1.0], [0.0, 0.1, 1.0],
         "shares of the requests constrained, comma-separated"),
        ("auto_shares", lambda s: [float(x) for x in s.split(",")], [0.1, 1.0], [0.1, 1.0],
         "shares of the requests in tool_choice auto, comma-separated"),
        ("tokenizer", str, None, None, "folder whose tokenizer and vocabulary a random model takes "
                                       "(the grammar needs real tokens)")],
    "tp": [
        ("tp_sizes", int_list, [1, 2], [1, 2], "tensor-parallel sizes, the first the baseline"),
        ("part", str, None, None, "offline or serve: run that part in this process (a child's)"),
        ("part_timeout", float, 150.0, 300.0, "seconds for each child"),
        ("decode_len", int, 128, 16, "new tokens of the batch-1 decode"),
        ("num_seqs", int, 64, 4, "offline requests"),
        ("max_output", int, 256, 8, "most output tokens of an offline request"),
        ("rates", rate_list, [32.0, math.inf], [8.0, math.inf], "requests/s of the server"),
        ("num_requests", int, 128, 4, "requests per rate"),
        ("input_len", int, 512, 16, "prompt tokens of a served request"),
        ("output_len", int, 64, 8, "output tokens of a served request")],
    "host": [
        ("batch_sizes", int_list, [1, 128, 256], [1, 16], "batches of steady decode"),
        ("rounds", int, 3, 3, "runs of each batch size (the median counts)"),
        ("against", str, None, None, "a folder whose nanoserve.py runs beside, in turns"),
        ("prompt_len", int, 128, 16, "prompt tokens of each row"),
        ("decode_len", int, 128, 32, "new tokens of each row")],
    "model": [
        ("tokenizer", str, None, None, "folder whose tokenizer and vocabulary the model takes, "
                                       "with a chat template in the family's format (default: "
                                       "a synthetic tokenizer, no chat)")],
    "spec": [
        ("num_speculative_tokens", int, 4, 4, "drafts per step (k)"),
        ("output_len", int, 128, 128, "most new tokens of a request"),
        ("repeats", int, 2, 3, "turns of each setting (cpu: the best counts)"),
        ("num_tasks", int, 4, 4, "the first N tasks (cpu)"),
        ("num_threads", int, 0, 0, "torch threads of both systems (cpu; 0: one per core)"),
        ("batch_sizes", int_list, [1, 2, 4, 8, 16, 32, 64, 128], [1], "verify-step batches (gpu)"),
        ("context", int, 512, 512, "context of the verify-step rows (gpu)"),
        ("num_seqs", int, 256, 8, "offline requests (gpu)"),
        ("max_output", int, 1024, 16, "most output tokens of an offline request (gpu)"),
        ("concurrency", int_list, [1, 4, 16, 32, 64], [1], "requests at once, rule lifted (gpu)"),
        ("agreement_prompts", int, 16, 4, "prompts of the bf16 agreement (gpu)")],
}


def parse_args(argv=None):
    common = argparse.ArgumentParser(add_help=False)
    g = common.add_argument_group("model and device")
    g.add_argument("--model", help="model folder (config.json, *.safetensors, tokenizer.json)")
    g.add_argument("--random", choices=sorted(RANDOM_MODELS),
                   help="random weights with these shapes (default: llama-3.2-1b on cuda, tiny on cpu)")
    g.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    g.add_argument("--dtype", help="default: bfloat16 on cuda, float32 on cpu")
    g.add_argument("--json", help="write hardware figures and every result line to this file")
    g.add_argument("--out-dir", default=str(REPO_DIR / "bench_out"), help="PNGs, server log, random models")
    g = common.add_argument_group("nanoserve engine (its own defaults unless set)")
    for name in ("block_size", "num_blocks", "max_num_seqs", "max_num_batched_tokens",
                 "tensor_parallel_size"):
        g.add_argument("--" + name.replace("_", "-"), type=int)
    g.add_argument("--attention", choices=["triton", "sdpa", "torch"])
    g.add_argument("--enforce-eager", action="store_true", default=None, help="no CUDA graphs")
    g.add_argument("--graphs-only", action="store_true", help="serve: skip the --enforce-eager pass")
    g.add_argument("--quantization", choices=["fp8"], help="fp8 weights (nanoserve only; GB/s count "
                                                           "the bytes read: 1 per layer weight)")
    g.add_argument("--kv-cache-dtype", choices=["fp8"], help="an fp8 e4m3 KV pool (nanoserve only; "
                                                             "GB/s count 1 byte per K or V value)")

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="mode", required=True)
    for mode, flags in SIZE_FLAGS.items():
        # the docstring's first paragraph, whole: argparse formats help (%), and wraps it
        summary = " ".join(MODES[mode].__doc__.split("\n\n")[0].split()).replace("%", "%%")
        p = sub.add_parser(mode, parents=[common], help=summary)
        for name, kind, gpu, cpu, text in flags:
            default = "" if gpu is None else f" (default {gpu} on cuda, {cpu} on cpu)"
            p.add_argument("--" + name.replace("_", "-"), type=kind, help=text + default)
        if mode in ("throughput", "latency"):
            p.add_argument("--systems", type=lambda s: s.split(","), default=DEFAULT_SYSTEMS[mode],
                           help=f"comma-separated, of {','.join(SYSTEMS)} (default: those installed)")

    args = parser.parse_args(argv)
    cuda = args.device.startswith("cuda")
    for name, _, gpu, cpu, _ in SIZE_FLAGS[args.mode]:
        if getattr(args, name) is None:
            setattr(args, name, gpu if cuda else cpu)
    if args.mode == "throughput":
        args.hf_num_seqs = args.hf_num_seqs or args.num_seqs
    unknown = set(getattr(args, "systems", [])) - set(SYSTEMS)
    if unknown:
        parser.error(f"unknown systems {sorted(unknown)}; choose from {','.join(SYSTEMS)}")
    args.dtype = args.dtype or ("bfloat16" if cuda else "float32")
    args.torch_dtype = getattr(torch, args.dtype)
    return args


def main(args):
    hw = hardware_info(args.device, args.torch_dtype) if args.mode != "model" else {}
    model_dir = None
    if args.mode != "kernel":
        name = args.random or ("llama-3.2-1b" if args.device.startswith("cuda") else "tiny")
        model_dir = Path(args.model) if args.model else build_random_model(
            name, args.out_dir, args.device, getattr(args, "tokenizer", None))
        log(f"model: {model_dir}")
    MODES[args.mode](args, model_dir, hw)
    if args.json:
        write_json(args.json, args.mode, args, hw)


if __name__ == "__main__":
    main(parse_args())
