"""Tests for nanoserve. transformers is the reference, and is imported here only.

    pytest -q test_nanoserve.py            # CPU: the Triton kernels run in the interpreter
    pytest -q test_nanoserve.py -k "cuda or triton"   # on a GPU machine: the GPU checks

Each layer is compared with its transformers counterpart at an explicit
tolerance (the worst difference is printed), the whole model token for token
under greedy decoding, and the engine's invariants as equalities: batched ==
one at a time, chunked prefill == whole prefill, preempted == not preempted,
and every KV block back in the pool afterwards.
"""

import asyncio
import concurrent.futures
import dataclasses
import gc
import importlib.util
import itertools
import json
import multiprocessing
import os
import random
import re
import select
import signal
import socket
import sys
import threading
import time
import types
import typing

import httpx
import llguidance
import pytest
import torch
import torch.nn.functional as F
import uvicorn

try:
    from openai import APIError, APIStatusError, AsyncOpenAI, OpenAI
except ImportError:        # a GPU box without the client: the server tests skip there
    OpenAI = None

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")   # before triton is imported

import download
import nanoserve as ns
import paged_attention as pa
from types import SimpleNamespace
from nanoserve import DEFAULT_MODEL, Config, build_app
from nanoserve import DefaultClient as EngineCoreClient   # the default server's

SMOL_DIR = ns.DEFAULT_MODEL
CUDA = torch.cuda.is_available()


def assert_close(name, ours, ref, tol):
    """Worst difference relative to the reference's largest magnitude."""
    diff = (ours.float() - ref.float()).abs().max().item()
    rel = diff / ref.float().abs().max().item()
    print(f"{name}: max abs diff {diff:.2e}, relative {rel:.2e} (tolerance {tol:.0e})")
    assert rel <= tol, f"{name}: relative diff {rel:.2e} > {tol:.0e}"


def check_pool_is_free(engine):
    """Every block is back: free, or kept only by the prefix cache with no user."""
    a = engine.allocator
    assert sum(a.ref_counts) == 0, "a block is still referenced"
    assert a.num_free_blocks == a.num_blocks
    kept = getattr(a, "evictable", ())                 # (part one's allocator keeps none)
    assert len(set(a.free_block_ids) | set(kept)) == a.num_blocks, "block lost"
    assert not engine.seqs and not engine.has_unfinished()


# ---------------------------------------------------------------------------
# Models: a tiny random Llama-3-style checkpoint, and the real SmolLM2 with
# transformers reading its GGUF itself as an independent reference.

@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """Llama-3 features in miniature: llama3 RoPE scaling (with positions past
    the original context), GQA 4:1, tied embeddings, head_dim 32."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, head_dim=32, vocab_size=512, max_position_embeddings=512,
        rms_norm_eps=1e-5, tie_word_embeddings=True, rope_theta=10000.0, bos_token_id=1,
        eos_token_id=2, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0,
                                      "original_max_position_embeddings": 64})
    hf = LlamaForCausalLM(config).eval()
    with torch.no_grad():   # larger weights than the default init, so outputs vary per token
        for p in hf.parameters():
            p.normal_(0, 0.3) if p.dim() > 1 else p.uniform_(0.5, 1.5)
    path = str(tmp_path_factory.mktemp("tiny"))
    hf.save_pretrained(path)
    return path, hf


FAMILIES = ["qwen3", "qwen2", "mistral"]


def tiny_family(model_type):
    """A module fixture: a tiny random checkpoint of model_type, written by transformers' own
    classes, with 2 KV heads (so 2 ranks split it). Qwen3 has a head_dim unlike D / n_heads and
    ties its embedding; Qwen2 has its q, k and v biases; Mistral is Llama's layers."""
    @pytest.fixture(scope="module", name=model_type)
    def fixture(tmp_path_factory):
        from transformers import AutoConfig, AutoModelForCausalLM
        torch.manual_seed(0)
        config = AutoConfig.for_model(
            model_type, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=512,
            max_position_embeddings=512, rms_norm_eps=1e-6, rope_theta=10000.0,
            tie_word_embeddings=model_type == "qwen3", sliding_window=None, bos_token_id=1,
            eos_token_id=2)
        hf = AutoModelForCausalLM.from_config(config).eval()
        with torch.no_grad():   # larger weights than the default init, so outputs vary per token
            for p in hf.parameters():
                p.normal_(0, 0.3) if p.dim() > 1 else p.uniform_(0.5, 1.5)
        path = str(tmp_path_factory.mktemp(model_type))
        hf.save_pretrained(path)
        return path, hf
    return fixture


qwen3, qwen2, mistral = (tiny_family(t) for t in FAMILIES)


def ensure_smol() -> str:
    """The default model's folder. pytest makes it when it is missing
    (download.py converts it, as `nanoserve.py generate` does on first use);
    only the tests that need it ask, so the kernel tests run without it."""
    if not os.path.isfile(os.path.join(SMOL_DIR, "config.json")):
        if importlib.util.find_spec("gguf") is None:
            pytest.skip("the default model is missing and download.py's converter (gguf) "
                        "is not installed")
        ns.ensure_default_model(SMOL_DIR)
    return SMOL_DIR


@pytest.fixture(scope="module")
def smol(tmp_path_factory):
    """The real SmolLM2-135M-Instruct: our converted folder, and transformers'
    own reading of the original GGUF file."""
    from transformers import AutoModelForCausalLM
    ensure_smol()
    gguf = download.find_gguf(tmp_path_factory.mktemp("gguf"))
    hf = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                              torch_dtype=torch.float32).eval()
    return SMOL_DIR, hf


@pytest.fixture(scope="module")
def smol_llm():
    return ns.LLM(ensure_smol(), device="cpu", num_blocks=256)


def hf_greedy(hf, prompt_ids, max_new_tokens):
    out = hf.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens,
                      min_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None,
                      pad_token_id=0, attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long))
    return out[0, len(prompt_ids):].tolist()


# ---------------------------------------------------------------------------
# Layers against transformers, fp32, ~1e-5

def prefill_meta(T, block_size=16):
    """Metadata for one sequence of T new tokens in blocks 0, 1, 2, ..."""
    num_blocks = -(-T // block_size)
    return ns.AttentionMetadata(
        slot_mapping=torch.arange(T), block_tables=torch.arange(num_blocks, dtype=torch.int32)[None],
        context_lens=torch.tensor([T], dtype=torch.int32),
        cu_seqlens_q=torch.tensor([0, T], dtype=torch.int32), is_decode=False)


def ours_and_hf(model_dir, hf, **settings):
    cfg = ns.Config(model=model_dir, device="cpu", num_blocks=64, block_size=16, **settings)
    model = ns.build_model(cfg)
    ns.quantize_fp8_weights(model, cfg)                # with quantization="fp8" (its chapter)
    for layer in model.layers:
        shape = (64, 16, cfg.num_kv_heads, cfg.head_dim)
        layer.attn.k_cache, layer.attn.v_cache = torch.zeros(shape), torch.zeros(shape)
    return cfg, model


def hf_layer_inputs(hf, x, T):
    pos = torch.arange(T)[None]
    cos_sin = hf.model.rotary_emb(x, pos)
    mask = torch.full((T, T), float("-inf")).triu(1)[None, None]  # causal, additive
    return cos_sin, mask


@pytest.mark.parametrize("which", ["tiny", "smol", *FAMILIES])
@torch.no_grad()
def test_layers_match_transformers(which, request):
    model_dir, hf = request.getfixturevalue(which)
    cfg, ours = ours_and_hf(model_dir, hf)
    T = 100 if which == "tiny" else 40                 # tiny: past the original 64 positions
    torch.manual_seed(1)
    x = torch.randn(T, cfg.hidden_size)
    positions = torch.arange(T)
    (cos, sin), mask = hf_layer_inputs(hf, x[None], T)
    me, them = ours.layers[0], hf.model.layers[0]
    assert_close("RMSNorm", me.input_layernorm(x), them.input_layernorm(x[None])[0], 1e-5)
    # RoPE: rotate random q and k, heads first as transformers has them
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
    q = torch.randn(T, cfg.num_heads, cfg.head_dim)
    k = torch.randn(T, cfg.num_kv_heads, cfg.head_dim)
    q_ref, k_ref = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    q_me, k_me = (pa.rope_ref(x, positions, ours.rope.cos, ours.rope.sin) for x in (q, k))
    assert_close("RoPE q", q_me, q_ref[0].transpose(0, 1), 1e-5)
    assert_close("RoPE k", k_me, k_ref[0].transpose(0, 1), 1e-5)
    attn_ref = them.self_attn(x[None], position_embeddings=(cos, sin), attention_mask=mask)[0][0]
    assert_close("attention", me.attn(x, positions, ours.rope, prefill_meta(T)), attn_ref, 1e-5)
    assert_close("MLP", me.mlp(x), them.mlp(x[None])[0], 1e-5)
    block_ref = them(x[None], attention_mask=mask, position_ids=positions[None],
                     position_embeddings=(cos, sin))
    block_ref = block_ref[0] if isinstance(block_ref, tuple) else block_ref
    assert_close("decoder layer", me(x, positions, ours.rope, prefill_meta(T)), block_ref[0], 1e-5)


@pytest.mark.parametrize("which", ["tiny", "smol", *FAMILIES])
@torch.no_grad()
def test_logits_match_transformers(which, request):
    model_dir, hf = request.getfixturevalue(which)
    cfg, ours = ours_and_hf(model_dir, hf)
    ids = torch.randint(0, cfg.vocab_size, (90,), generator=torch.Generator().manual_seed(2))
    logits = ours.compute_logits(ours(ids, torch.arange(90), prefill_meta(90)))
    ref = hf(ids[None]).logits[0]
    assert_close("logits", logits, ref, 1e-5)
    assert (logits.argmax(-1) == ref.argmax(-1)).all()


# ---------------------------------------------------------------------------
# Whole model, greedy, token for token

def test_tiny_greedy_matches_transformers(tiny):
    path, hf = tiny
    llm = ns.LLM(path, device="cpu", num_blocks=64, block_size=8)
    prompts = [list(range(5, 16)), [20, 21, 22], list(range(30, 90))]   # 60 + 40 > 64 positions
    outs = llm.generate(prompts, ns.SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    for p, o in zip(prompts, outs):
        assert o.token_ids == hf_greedy(hf, p, 40)
    check_pool_is_free(llm.engine)


FAMILY_PROMPTS = [list(range(5, 16)), [20, 21, 22], list(range(30, 90))]


def _family_generate(path, tp, queue, kv_cache_dtype="auto"):
    """Greedy tokens of FAMILY_PROMPTS at tp gloo ranks, with drafts (speculative decoding)."""
    llm = ns.LLM(path, device="cpu", num_blocks=64, block_size=8, num_threads=1,
                 tensor_parallel_size=tp, num_speculative_tokens=3, kv_cache_dtype=kv_cache_dtype)
    params = ns.SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    queue.put([o.token_ids for o in llm.generate(FAMILY_PROMPTS, params)])
    llm.close()


@pytest.mark.parametrize("which", FAMILIES)
def test_family_greedy_matches_transformers(which, request):
    """Each family decodes greedily as transformers does, token for token: alone, again from the
    prefix cache, and over 2 gloo ranks with drafts (the shard rule cuts the q, k and v biases
    as their rows; each rank keeps the per-head norms whole)."""
    path, hf = request.getfixturevalue(which)
    ref = [hf_greedy(hf, p, 24) for p in FAMILY_PROMPTS]
    llm = ns.LLM(path, device="cpu", num_blocks=64, block_size=8)
    params = ns.SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    for _ in range(2):                       # the second time, the prompts' blocks are cached
        assert [o.token_ids for o in llm.generate(FAMILY_PROMPTS, params)] == ref
    assert llm.engine.scheduler.num_cached_tokens > 0
    check_pool_is_free(llm.engine)
    queue = torch.multiprocessing.get_context("spawn").Queue()
    run_processes(_family_generate, [(path, 2, queue)])
    assert queue.get(timeout=10) == ref


def test_unknown_families_and_sliding_windows_are_refused(mistral, tmp_path):
    """An unknown model_type gets one line naming the supported ones. A sliding window shorter
    than the context served is refused, unless the context is cut to it."""
    config = json.loads(open(os.path.join(mistral[0], "config.json")).read())
    for name in os.listdir(mistral[0]):
        (tmp_path / name).symlink_to(os.path.join(mistral[0], name))
    for changes, words in [({"model_type": "gemma"}, "'gemma' is unsupported (llama, mistral"),
                           ({"sliding_window": 256}, "sliding_window 256 is unsupported")]:
        (tmp_path / "config.json").unlink()
        (tmp_path / "config.json").write_text(json.dumps(config | changes))
        with pytest.raises(ValueError, match=re.escape(words)) as e:
            Config(model=str(tmp_path), device="cpu")
        assert "\n" not in str(e.value)
    assert Config(model=str(tmp_path), device="cpu", max_model_len=256).max_model_len == 256


def test_only_the_models_own_weight_files_are_read(mistral, tmp_path):
    """A Mistral folder fetched with the hub's own tools also holds consolidated.safetensors: the
    same weights under Mistral's own names. The loader reads the files transformers reads, and
    no other: model.safetensors, or the shards that model.safetensors.index.json lists. Both
    kinds of folder, with a consolidated file beside them, give the checkpoint's greedy tokens."""
    from safetensors.torch import save_file
    path, hf = mistral
    params = ns.SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompt = list(range(3, 19))
    ref = ns.LLM(path, device="cpu", num_blocks=16).generate(prompt, params)[0].token_ids
    whole, sharded = tmp_path / "whole", tmp_path / "sharded"
    whole.mkdir()
    for name in os.listdir(path):
        (whole / name).symlink_to(os.path.join(path, name))
    hf.save_pretrained(sharded, max_shard_size="100KB")
    assert len(list(sharded.glob("model-*.safetensors"))) > 1
    mistral_names = {"tok_embeddings.weight": hf.model.embed_tokens.weight,
                     "layers.0.attention.wq.weight": hf.model.layers[0].self_attn.q_proj.weight}
    for folder in (whole, sharded):
        save_file({k: v.detach().clone() for k, v in mistral_names.items()},
                  str(folder / "consolidated.safetensors"))
        llm = ns.LLM(str(folder), device="cpu", num_blocks=16)
        assert llm.generate(prompt, params)[0].token_ids == ref, folder.name


SMOL_PROMPTS = ["The capital of France is",
                "def fibonacci(n):",
                "Once upon a time, in a small village by the sea, there lived an old fisherman "
                "who had a secret. Every morning he",
                "1, 2, 3, 4,"]


def test_smol_greedy_matches_transformers(smol, smol_llm):
    _, hf = smol
    tok = smol_llm.front.tokenizer
    outs = smol_llm.generate(SMOL_PROMPTS, ns.SamplingParams(temperature=0, max_tokens=24,
                                                             ignore_eos=True))
    for prompt, o in zip(SMOL_PROMPTS, outs):
        ref = hf_greedy(hf, tok.encode(prompt).ids, 24)
        print(repr(prompt), "->", repr(o.text))
        assert o.token_ids == ref
    assert "Paris" in outs[0].text
    check_pool_is_free(smol_llm.engine)


# ---------------------------------------------------------------------------
# Engine equalities

GREEDY = ns.SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


def test_batched_equals_one_at_a_time(smol_llm):
    batched = smol_llm.generate(SMOL_PROMPTS, GREEDY)
    for prompt, o in zip(SMOL_PROMPTS, batched):
        assert smol_llm.generate([prompt], GREEDY)[0].token_ids == o.token_ids
    check_pool_is_free(smol_llm.engine)


def test_scheduler_runs_as_its_example():
    """The Scheduler section's example, step by step, on part one's engine: a chunked prompt, a
    preemption when the pool runs dry, and the victim's recompute of prompt and output."""
    ensure_smol()
    cfg = Config(device="cpu", part_one=True, num_blocks=5, block_size=4,
                 max_num_batched_tokens=8, max_num_seqs=4, num_threads=1)
    core = ns.EngineCore(cfg)
    for name, prompt_len, n in (("A", 10, 6), ("B", 5, 4)):
        core.add_request(ns.EngineCoreRequest(name, list(range(100, 100 + prompt_len)),
                         ns.SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)))
    schedule, steps = core.scheduler.schedule, []

    def traced():
        batch = schedule()
        steps.append([(s.request_id, n) for s, n in zip(batch.seqs, batch.num_new_tokens)])
        return batch
    core.scheduler.schedule = traced
    seqs = dict(core.seqs)
    preempted_at, ends = [], {}
    while core.has_unfinished():
        before = core.scheduler.num_preemptions
        for out in core.step():
            if out.finish_reason:
                ends[out.request_id] = (len(steps) - 1, out.finish_reason)
        if core.scheduler.num_preemptions > before:
            preempted_at.append(len(steps) - 1)
        if len(steps) == 2:                 # after step 1: the pool is full
            assert core.allocator.num_free_blocks == 0
    assert steps == [[("A", 8)], [("A", 2), ("B", 5)], [("A", 1), ("B", 1)], [("A", 1), ("B", 1)],
                     [("A", 1)], [("A", 1)], [("A", 1)], [("B", 8)]]
    assert preempted_at == [4] and ends == {"A": (6, "length"), "B": (7, "length")}
    assert [len(seqs[r].token_ids) for r in "AB"] == [16, 9]
    check_pool_is_free(core)


def test_part_one_equals_default():
    """Part one's engine alone (part_one, the CLI's --part-one) gives the default engine's tokens
    on plain requests: greedy and seeded, prompts whole and in chunks, with and without
    preemption. It is part one's classes and none of the chapters' (the default engine is
    assembled from subclasses of them)."""
    seeded = ns.SamplingParams(temperature=0.8, top_p=0.9, top_k=40, seed=3, max_tokens=16)
    prompts, params = SMOL_PROMPTS + SMOL_PROMPTS[:2], [GREEDY] * len(SMOL_PROMPTS) + [seeded] * 2
    for settings in (dict(num_blocks=64), dict(num_blocks=6, max_num_batched_tokens=8,
                                               max_num_seqs=4)):
        runs, preemptions = {}, {}
        for part_one in (False, True):
            llm = ns.LLM(SMOL_DIR, device="cpu", part_one=part_one, **settings)
            engine = llm.engine
            assert (type(engine), type(engine.scheduler), type(engine.runner),
                    type(engine.allocator)) == ((ns.EngineCore, ns.Scheduler, ns.ModelRunner,
                                                 ns.BlockAllocator) if part_one else
                                                (ns.DefaultEngineCore, ns.DefaultScheduler,
                                                 ns.DefaultRunner, ns.PrefixCachingAllocator))
            runs[part_one] = [o.token_ids for o in llm.generate(prompts, params)]
            preemptions[part_one] = engine.scheduler.num_preemptions
            check_pool_is_free(engine)
        print(settings, "preemptions (default, part one):", preemptions[False], preemptions[True])
        assert runs[True] == runs[False]
        assert all(len(ids) == p.max_tokens for ids, p in zip(runs[True], params))
    assert preemptions[True] > 0 and preemptions[False] > 0, "the small pool preempted no one"


def test_part_one_refuses_what_only_a_chapter_reads():
    """--part-one with a setting that only a chapter reads is refused, one line from the CLI,
    rather than run without it. The fp8 KV pool is the chapter's runner's, not part one's."""
    for name, value in (("kv_cache_dtype", "fp8"), ("quantization", "fp8"),
                        ("num_speculative_tokens", 3),
                        ("tensor_parallel_size", 2), ("api_key", "k"), ("max_request_bytes", 10),
                        ("tool_call_parser", "hermes")):   # the last three: its server has none
        with pytest.raises(ValueError, match=f"part one's engine \\(--part-one\\) has no {name}"):
            ns.Config(device="cpu", part_one=True, **{name: value})
    with pytest.raises(SystemExit) as e:
        ns.main(["generate", "hi", "--part-one", "--kv-cache-dtype", "fp8"])
    assert str(e.value.code).startswith("error: part one's engine (--part-one) has no kv_cache")
    cfg = ns.Config(SMOL_DIR, device="cpu", kv_cache_dtype="fp8")
    assert ns.Fp8KVCacheRunner.kv_cache_dtype.fget(SimpleNamespace(cfg=cfg)) == pa.FP8
    assert ns.ModelRunner.kv_cache_dtype.fget(SimpleNamespace(cfg=cfg)) == torch.float32
    assert issubclass(ns.DefaultRunner, ns.Fp8KVCacheRunner)


def test_part_one_server_answers_the_openai_client(smol_llm):
    """Part one's server (its EngineCoreClient steps the engine core in a thread) answers
    completions and chat, streamed and not, as the default engine offline; a client that leaves
    mid-stream has its blocks freed."""
    cfg = server_config(part_one=True)
    client = ns.EngineCoreClient(cfg)
    srv = ServerThread(build_app(client, cfg))
    try:
        assert type(client.engine) is ns.EngineCore
        oai = OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        prompt, kw = "The capital of France is", dict(model=MODEL, temperature=0, max_tokens=10)
        ref = smol_llm.generate(prompt, ns.SamplingParams(temperature=0, max_tokens=10))[0].text
        r = oai.completions.create(prompt=prompt, **kw)
        text, finish, _, _ = stream_completion(oai, prompt=prompt, **kw)
        assert r.choices[0].text == text == ref and finish == [r.choices[0].finish_reason]
        messages = [{"role": "user", "content": "What is the capital of France?"}]
        chat = oai.chat.completions.create(messages=messages, **kw).choices[0].message.content
        streamed, _ = stream_chat(oai, messages=messages, **kw)
        offline = smol_llm.generate(client.front.encode(client.front.chat_template.render(
            messages), add_special_tokens=False), ns.SamplingParams(temperature=0, max_tokens=10))
        assert chat == streamed == offline[0].text and chat
        for field, value in (("logprobs", 2), ("logit_bias", {"7": 5}), ("stop", ["."])):   # a chapter's: a 400
            bad = httpx.post(srv.url + "/v1/completions", json={field: value, "prompt": prompt})
            assert bad.status_code == 400, (field, bad.text)
            assert f"part one's engine (--part-one) has no {field}" in bad.json()["error"]["message"]
        stream = oai.completions.create(prompt=prompt, stream=True, model=MODEL, max_tokens=2000,
                                        temperature=0, extra_body={"ignore_eos": True})
        next(iter(stream))
        stream.close()
        deadline = time.time() + 30
        while client.engine.has_unfinished() and time.time() < deadline:
            time.sleep(0.05)
        check_pool_is_free(client.engine)
    finally:
        srv.stop()
        client.shutdown()


def test_part_one_server_keeps_what_a_failed_step_finished(monkeypatch):
    """Part one's server, at a step that raises in _commit after one request finished there:
    that request gets its last output, and the others end in error; every block is back."""
    client = ns.EngineCoreClient(server_config(part_one=True))
    engine, step = client.engine, client.engine.step
    for i, n in enumerate((1, 8)):
        engine.add_request(ns.EngineCoreRequest(f"r{i}", [1, 2, 3], ns.SamplingParams(
            temperature=0, max_tokens=n, ignore_eos=True)))

    def failing_step():                 # the first row's output is made, then the fault
        append = engine._append_token
        monkeypatch.setattr(engine, "_append_token", lambda seq, *row: (
            append(seq, *row) if seq.request_id == "r0" else 1 / 0))
        return step()
    monkeypatch.setattr(engine, "step", failing_step)
    outputs = client._step()
    assert [(o.request_id, o.finish_reason) for o in outputs] == [("r0", "length"),
                                                                  ("r1", "error")]
    assert outputs[0].token_id is not None and not engine.seqs
    check_pool_is_free(engine)


def test_part_one_server_whose_engine_thread_fails(monkeypatch):
    """Part one's server, when its engine core's thread raises outside a step (here in
    add_request): the request in flight ends in error, /health turns 503, and a later request is
    a 503; none hangs."""
    cfg = server_config(part_one=True)
    client = ns.EngineCoreClient(cfg)
    monkeypatch.setattr(client.engine, "add_request", lambda request: 1 / 0)
    srv = ServerThread(build_app(client, cfg))
    try:
        post = lambda: httpx.post(srv.url + "/v1/completions", timeout=30,
                                  json={"prompt": "Hi", "max_tokens": 4})
        r = post()
        assert r.status_code == 500 and "ZeroDivisionError" in r.json()["error"]["message"], r.text
        client.thread.join(10)                 # it ends once it has scheduled fail_all
        assert not client.thread.is_alive() and not client.front.states
        health = httpx.get(srv.url + "/health", timeout=10)
        assert health.status_code == 503 and "the engine core stopped" in health.text
        assert post().status_code == 503
    finally:
        srv.stop()
        client.shutdown()


def test_async_scheduling_off_equals_on(smol_llm):
    """Without async scheduling each step is read back before the next is scheduled: the
    scheduler never sees a pending token, and greedy, seeded and drafting output are as with it."""
    seeded = ns.SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=12)
    drafting = ns.SamplingParams(temperature=0, max_tokens=24)
    on = smol_llm.generate(SMOL_PROMPTS + SMOL_PROMPTS[:2], [GREEDY] * len(SMOL_PROMPTS)
                           + [seeded, drafting])
    off = ns.LLM(SMOL_DIR, device="cpu", num_blocks=64, async_scheduling=False,
                 num_speculative_tokens=4)
    schedule, pending = off.engine.scheduler.schedule, []
    def recorded():
        pending.extend(s.num_pending_tokens for s in off.engine.scheduler.running)
        return schedule()
    off.engine.scheduler.schedule = recorded
    outs = off.generate(SMOL_PROMPTS + SMOL_PROMPTS[:2], [GREEDY] * len(SMOL_PROMPTS)
                        + [seeded, drafting])
    assert [o.token_ids for o in outs] == [o.token_ids for o in on]
    assert pending and not any(pending), "a pending token crossed a step"
    assert off.engine.scheduler.speculation.num_draft_tokens > 0, "nothing drafted"
    check_pool_is_free(off.engine)


def test_chunked_prefill_equals_whole_prefill(smol_llm):
    whole = smol_llm.generate(SMOL_PROMPTS, GREEDY)
    # A 7-token budget splits every prompt into chunks, mixed with decodes.
    chunked = ns.LLM(SMOL_DIR, device="cpu", num_blocks=64, max_num_batched_tokens=7, max_num_seqs=4,
                     enable_prefix_caching=False)
    outs = chunked.generate(SMOL_PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == [o.token_ids for o in whole]
    check_pool_is_free(chunked.engine)


def test_decodes_wait_at_a_burst(smol_llm):
    """While the prompts waiting fill whole steps, running sequences decode only every
    DECODES_EVERY-th step (the Scheduler's burst rule), and the output is as without it."""
    whole = smol_llm.generate(SMOL_PROMPTS, GREEDY)      # a budget of 8,192: the rule never applies
    llm = ns.LLM(SMOL_DIR, device="cpu", num_blocks=256, max_num_batched_tokens=16,
                 max_num_seqs=16, enable_prefix_caching=False)
    scheduler, steps = llm.engine.scheduler, []          # (a burst?, step number, decodes run)
    schedule = scheduler.schedule

    def recorded():
        burst = sum(seq.num_tokens for seq in scheduler.waiting) >= 16
        batch = schedule()
        decodes = sum(n == 1 and seq.num_computed_tokens >= seq.num_prompt_tokens
                      for seq, n in zip(batch.seqs, batch.num_new_tokens))
        steps.append((burst, scheduler.num_steps, decodes))
        return batch
    scheduler.schedule = recorded
    outs = llm.generate(SMOL_PROMPTS * 3, GREEDY)         # 12 prompts: a backlog of whole steps
    assert [o.token_ids for o in outs] == [o.token_ids for o in whole] * 3
    waited = [d for burst, i, d in steps if burst and i % ns.BurstRuleScheduler.DECODES_EVERY]
    rode = [d for burst, i, d in steps if burst and not i % ns.BurstRuleScheduler.DECODES_EVERY]
    assert waited and not any(waited), "a decode ran while prompts filled the step"
    assert any(rode), "decodes never rode along with the burst"
    check_pool_is_free(llm.engine)


def test_preemption_keeps_output(smol_llm):
    whole = smol_llm.generate(SMOL_PROMPTS, GREEDY)
    # 4 sequences of up to 47 tokens need 12+ blocks of 8 at the end: 9 cannot hold them.
    small = ns.LLM(SMOL_DIR, device="cpu", num_blocks=9, block_size=8, enable_prefix_caching=False)
    outs = small.generate(SMOL_PROMPTS, GREEDY)
    assert small.stats()["preemptions_total"] > 0
    assert [o.token_ids for o in outs] == [o.token_ids for o in whole]
    check_pool_is_free(small.engine)


def test_failed_step_keeps_the_waiting_sequences(smol_llm):
    """A step that raises fails the running sequences (fail_running); one preempted while that
    step was scheduled waits with no stale pending token, then ends as if nothing had happened."""
    whole = smol_llm.generate(SMOL_PROMPTS, GREEDY)
    small = ns.LLM(SMOL_DIR, device="cpu", num_blocks=9, block_size=8, enable_prefix_caching=False)
    engine, launch, failed = small.engine, small.engine.runner.launch, []

    def launch_failing_after_a_preemption(batch, prev=None):
        if engine.scheduler.num_preemptions and not failed:
            failed.append([s.request_id for s in engine.scheduler.waiting])
            raise RuntimeError("injected failure")
        return launch(batch, prev)
    engine.runner.launch = launch_failing_after_a_preemption
    states = [small.add(small.front.encode(p), GREEDY) for p in SMOL_PROMPTS]
    for _ in range(400):             # bounded: a stale pending token made this loop forever
        try:
            outputs = engine.step()
        except RuntimeError as e:
            outputs = ns.fail_running(engine, e)
        small.front.process(outputs)
    assert not engine.has_unfinished()
    assert failed and failed[0], "no preemption before the failure"
    kept = [(s, w) for s, w in zip(states, whole) if s.request_id in failed[0]]
    assert kept and all(s.finish_reason == "length" for s, _ in kept)
    assert [s.token_ids for s, _ in kept] == [w.token_ids for _, w in kept]
    check_pool_is_free(engine)


def test_failed_sample_keeps_what_the_step_read_back(smol_llm, monkeypatch):
    """A step reads the previous step's tokens back before it samples its own. If sampling
    raises, a request that the read-back finished (A, one token) still ends as it should; only
    the requests of the failed step end in error (B); LLM.run then raises."""
    runner, calls = smol_llm.engine.runner, []
    sample = runner.sample

    def sample_failing_the_second_time(step):
        calls.append(step)
        if len(calls) == 2:
            raise RuntimeError("injected failure")
        sample(step)
    monkeypatch.setattr(runner, "sample", sample_failing_the_second_time)
    a, b = [smol_llm.add(smol_llm.front.encode(p), ns.SamplingParams(
        temperature=0, max_tokens=n, ignore_eos=True)) for p, n in zip(SMOL_PROMPTS, (1, 5))]
    with pytest.raises(RuntimeError, match="injected failure"):
        for _ in smol_llm.run():
            pass
    assert (a.finish_reason, len(a.token_ids)) == ("length", 1)
    assert b.finish_reason == "error" and "injected failure" in b.error
    assert not smol_llm.engine.has_unfinished()
    check_pool_is_free(smol_llm.engine)


def test_failed_launch_keeps_what_the_step_before_sampled(smol_llm, monkeypatch):
    """Step N+1 is launched before step N is read back. If that launch raises, a request that
    step N finished (A, one token, not in step N+1) still ends as it should, "length" with its
    token; only B, which step N+1 runs, ends in error."""
    runner, calls = smol_llm.engine.runner, []
    launch = runner.launch

    def launch_failing_the_second_time(batch, prev=None):
        calls.append(batch)
        if len(calls) == 2:
            assert [s.params.max_tokens for s in batch.seqs] == [5]   # B alone
            raise RuntimeError("injected failure")
        return launch(batch, prev)
    monkeypatch.setattr(runner, "launch", launch_failing_the_second_time)
    a, b = [smol_llm.add(smol_llm.front.encode(p), ns.SamplingParams(
        temperature=0, max_tokens=n, ignore_eos=True)) for p, n in zip(SMOL_PROMPTS, (1, 5))]
    with pytest.raises(RuntimeError, match="injected failure"):
        for _ in smol_llm.run():
            pass
    assert (a.finish_reason, len(a.token_ids)) == ("length", 1), (a.finish_reason, a.error)
    assert b.finish_reason == "error" and "injected failure" in b.error
    check_pool_is_free(smol_llm.engine)


@pytest.mark.parametrize("where", ["_append_token", "accept"])
def test_faults_inside_commit_lose_no_request(tiny, monkeypatch, where):
    """A fault at any row of _commit's loop fails the running requests (fail_running) and no
    other: a request that an earlier row of the same loop finished keeps its end, where behind
    the server its client would wait for ever. A small fuzz: 40 requests of 1 to 12 tokens, with
    drafts, arriving a few at each step, and faults at random rows of the loop, in appending a
    token or accepting drafts. Every request ends, none is lost, and every block is back."""
    llm = ns.LLM(tiny[0], device="cpu", num_blocks=128, block_size=8, num_speculative_tokens=2)
    engine, rng = llm.engine, random.Random(0)
    monkeypatch.setattr(ns.NgramIndex, "propose", lambda self, token_ids, k: token_ids[-k:])
    owner = engine if where == "_append_token" else engine.scheduler.speculation
    row = getattr(owner, where)

    def faulty(*args):
        if rng.random() < 0.04:
            raise RuntimeError("injected failure")
        return row(*args)
    monkeypatch.setattr(owner, where, faulty)
    monkeypatch.setattr(engine.cfg, "max_num_seqs", 8)
    states, num_faults = [], 0
    for _ in range(500):           # bounded: a lost request would loop for ever behind a server
        while len(states) < 40 and rng.random() < 0.5:     # a few arrive at each step
            states.append(llm.add([rng.randrange(3, 512) for _ in range(rng.randint(2, 20))],
                                  ns.SamplingParams(temperature=0, max_tokens=rng.randint(1, 12),
                                                    ignore_eos=True)))
        if len(states) == 40 and not engine.has_unfinished():
            break
        try:
            outputs = engine.step()
        except RuntimeError as e:
            outputs, num_faults = ns.fail_running(engine, e), num_faults + 1
        llm.front.process(outputs)
    lost = [s.request_id for s in states if s.finish_reason is None]
    ends = [s.finish_reason for s in states]
    print(f"{num_faults} faults; {ends.count('length')} ended by length, {ends.count('error')} "
          f"in error, {len(lost)} lost")
    assert num_faults > 0 and not lost and not llm.front.states
    assert {"length", "error"} == set(ends)
    for s in states:
        assert len(s.token_ids) == s.params.max_tokens if s.finish_reason == "length" else \
            "injected failure" in s.error
    check_pool_is_free(engine)


def test_a_fault_in_commit_keeps_a_preempted_grammar_in_step(monkeypatch):
    """A fault in _commit's row loop while a grammar request that the step after preempted
    waits (async scheduling). GrammarMasks.follow moves every row's matcher before the loop, so
    the request, which survives (fail_running ends the running ones), resumed one token ahead of
    its text and ended "stop" on broken JSON. Now fail_running moves the matcher back: its
    output is the fault-free run's."""
    llm = ns.LLM(SMOL_DIR, device="cpu", num_blocks=14, block_size=4)
    engine, masks = llm.engine, llm.engine.runner.grammar_masks
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
              "age": {"type": "integer"}}, "required": ["name", "age"]}
    plain = ns.SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    shaped = ns.SamplingParams(temperature=0, max_tokens=40, grammar=llm.front.grammar(
        json.dumps(schema)))
    prompts = ["Once upon a time", "The capital of France is", "Hello, my name is",
               "A person as JSON:"]

    def run():
        states = [llm.add(llm.front.encode(p), shaped if i == 3 else plain)
                  for i, p in enumerate(prompts)]
        num_faults = 0
        while engine.has_unfinished():
            try:
                outputs = engine.step()
            except RuntimeError as e:
                outputs, num_faults = ns.fail_running(engine, e), num_faults + 1
            llm.front.process(outputs)
        check_pool_is_free(engine)
        return states[3], num_faults
    ref, _ = run()
    followed, append = [], engine._append_token

    def follow(seqs, tokens):               # the rows whose matchers moved in this _commit
        followed[:] = [s for s in seqs if s.matcher is not None and not s.is_finished]
        return ns.GrammarMasks.follow(masks, seqs, tokens)

    def faulty(seq, *row):                  # once: a row before a waiting grammar row
        if not faulty.done and seq.matcher is None and any(
                s.status == "waiting" for s in followed):
            faulty.done = True
            raise RuntimeError("injected failure")
        return append(seq, *row)
    faulty.done = False
    monkeypatch.setattr(masks, "follow", follow)
    monkeypatch.setattr(engine, "_append_token", faulty)
    out, num_faults = run()
    print(f"fault-free {ref.text!r} ({ref.finish_reason}); with the fault {out.text!r} "
          f"({out.finish_reason})")
    assert num_faults == 1 and ref.finish_reason == "stop"
    json.loads(ref.text)
    assert (out.text, out.finish_reason) == (ref.text, ref.finish_reason)


@pytest.mark.parametrize("failure", [RuntimeError("injected failure"), KeyboardInterrupt()])
def test_failed_generate_ends_its_waiting_requests(smol_llm, monkeypatch, failure):
    """A generate whose step raises, or that Ctrl-C stops, ends every one of its requests,
    running or waiting (two seats: two of four wait). The next generate runs only its own."""
    engine, launch, calls = smol_llm.engine, smol_llm.engine.runner.launch, []

    def launch_failing_the_second_time(batch, prev=None):
        calls.append(batch)
        if len(calls) == 2:
            raise failure
        return launch(batch, prev)
    monkeypatch.setattr(engine.runner, "launch", launch_failing_the_second_time)
    monkeypatch.setattr(engine.cfg, "max_num_seqs", 2)
    with pytest.raises(type(failure)):
        smol_llm.generate(SMOL_PROMPTS, ns.SamplingParams(temperature=0, max_tokens=8))
    assert len(engine.scheduler.waiting) == 0 and not engine.has_unfinished()
    check_pool_is_free(engine)
    monkeypatch.undo()
    before = smol_llm.stats()["generated_tokens_total"]
    [out] = smol_llm.generate(SMOL_PROMPTS[0], ns.SamplingParams(max_tokens=5, ignore_eos=True))
    assert len(out.token_ids) == 5
    assert smol_llm.stats()["generated_tokens_total"] - before == 5


@pytest.mark.parametrize("where", ["detokenize", "abort", "progress", "close"])
def test_interrupted_run_ends_its_requests(smol_llm, monkeypatch, where):
    """Ctrl-C anywhere in LLM.run's loop, not only in a step, ends every request of the call,
    running or waiting (two seats: two of four wait). It may come while the front end
    detokenizes, while a request that a stop string ended is aborted, or at generate's progress
    line; a caller may also close the loop. The next generate runs only its own: 5 tokens."""
    engine, front, calls = smol_llm.engine, smol_llm.front, []

    def interrupt_the_second_time(call):
        def interrupted(*args, **kwargs):
            calls.append(1)
            if len(calls) == 2:
                raise KeyboardInterrupt
            return call(*args, **kwargs)
        return interrupted
    monkeypatch.setattr(engine.cfg, "max_num_seqs", 2)
    # the fourth prompt stops at once: "1, 2, 3, 4," goes on " 5,"
    params = [ns.SamplingParams(temperature=0, max_tokens=8, stop=[","])] * 4
    if where == "close":
        states = [smol_llm.add(front.encode(p), q, incremental=True)
                  for p, q in zip(SMOL_PROMPTS, params)]
        steps = smol_llm.run()
        next(steps)
        steps.close()
    else:
        owner, name = {"detokenize": (front, "_detokenize"), "abort": (engine, "abort_request"),
                       "progress": (ns, "_progress")}[where]
        monkeypatch.setattr(owner, name, interrupt_the_second_time(getattr(owner, name)))
        with pytest.raises(KeyboardInterrupt):
            smol_llm.generate(SMOL_PROMPTS + SMOL_PROMPTS[3:], params + params[:1])
    monkeypatch.undo()
    assert not engine.has_unfinished() and not front.states
    if where == "close":
        assert all(s.finish_reason is not None for s in states)
    check_pool_is_free(engine)
    before = smol_llm.stats()["generated_tokens_total"]
    [out] = smol_llm.generate(SMOL_PROMPTS[0], ns.SamplingParams(max_tokens=5, ignore_eos=True))
    assert len(out.token_ids) == 5
    assert smol_llm.stats()["generated_tokens_total"] - before == 5


def test_stop_strings_and_tokens(smol_llm):
    base = smol_llm.generate(["1, 2, 3, 4,"], GREEDY)[0]
    assert " 5, 6" in base.text
    params = ns.SamplingParams(temperature=0, max_tokens=20, stop=[" 6"])
    out = smol_llm.generate(["1, 2, 3, 4,"], params)[0]
    assert out.finish_reason == "stop" and out.text == base.text[:base.text.index(" 6")]
    ids = base.token_ids   # stop on the first token that was not generated before
    i = next(i for i in range(2, len(ids)) if ids[i] not in ids[:i])
    out = smol_llm.generate(["1, 2, 3, 4,"], ns.SamplingParams(temperature=0, max_tokens=20,
                                                               stop_token_ids=[ids[i]]))[0]
    assert out.finish_reason == "stop" and out.token_ids == ids[:i + 1]
    out = smol_llm.generate(["1, 2, 3, 4,"], ns.SamplingParams(temperature=0, max_tokens=3))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 3
    check_pool_is_free(smol_llm.engine)


def test_stop_strings_cut_at_the_earliest_match(smol_llm):
    """With several stop strings in the new text, the earliest match cuts it, whatever their
    order in the list (the text must contain none of them)."""
    state = ns.RequestState("r", [1], ns.SamplingParams(stop=["b", "a"]), incremental=True)
    state.text = "xab"
    assert ns._truncate_at_stop_string(smol_llm.front, state, 1) and state.text == "x"


def test_stop_string_completed_by_the_last_token(smol_llm):
    """Stop strings are checked on every token, the one that reaches
    max_tokens too: a match there cuts the text and finishes with "stop"."""
    prompt = "The capital of France is"
    full = smol_llm.generate([prompt], ns.SamplingParams(temperature=0, max_tokens=5))[0]
    assert full.text.endswith("he") and "he" not in smol_llm.front.decode(full.token_ids[:4]), \
        f"the 5th token must complete the stop string for this test to mean anything: {full.text!r}"
    out = smol_llm.generate([prompt], ns.SamplingParams(temperature=0, max_tokens=5, stop=["he"]))[0]
    print(f"full {full.text!r}, cut {out.text!r}")
    assert out.text == full.text[:full.text.index("he")] and out.finish_reason == "stop"
    check_pool_is_free(smol_llm.engine)


def test_token_id_prompts_and_order(smol_llm):
    ids = smol_llm.front.tokenizer.encode("The capital of France is").ids
    outs = smol_llm.generate(["def fibonacci(n):", ids], GREEDY)
    assert outs[1].prompt_token_ids == ids
    assert outs[1].token_ids == smol_llm.generate([SMOL_PROMPTS[0]], GREEDY)[0].token_ids


def test_engine_triton_and_sdpa_attention_equal_torch(tiny):
    """The whole engine with the Triton kernels (interpreted on CPU) and with the
    CPU path (sdpa) against the torch references and transformers, fp32, with
    chunked prefills mixed into decodes (and, on CUDA, every step's forward
    pass replayed from a CUDA graph)."""
    path, hf = tiny
    device = "cuda" if CUDA else "cpu"
    prompts = [list(range(5, 16)), [20, 21, 22], list(range(30, 90))]
    n = 40 if CUDA else 6
    params = ns.SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    outs = {}
    for attention in ("torch", "sdpa", "triton"):
        llm = ns.LLM(path, device=device, dtype="float32", attention=attention, num_blocks=64,
                     block_size=8, max_num_batched_tokens=32, max_num_seqs=4)
        outs[attention] = [o.token_ids for o in llm.generate(prompts, params)]
        check_pool_is_free(llm.engine)
    assert outs["triton"] == outs["torch"] and outs["sdpa"] == outs["torch"]
    assert outs["torch"] == [hf_greedy(hf, p, n) for p in prompts]


# ---------------------------------------------------------------------------
# Prefix caching

def shared_prefix_prompts(tokenizer):
    """Prompts sharing prefixes that end on a block boundary (32 = 2 blocks of
    16), one token either side of it, and a prompt repeated whole."""
    base = tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 8).ids
    return [base[:32] + [504, 3575], base[:31] + [504], base[:33] + [3575, 28],
            base[:48], base[:48], base[:17] + [30, 31], base[:60]]


def test_prefix_caching_keeps_output(smol_llm):
    prompts = shared_prefix_prompts(smol_llm.front.tokenizer)
    seeded = [ns.SamplingParams(temperature=0.9, top_k=50, max_tokens=12, seed=i,
                                ignore_eos=True) for i in range(len(prompts))]
    no_cache = ns.LLM(SMOL_DIR, device="cpu", num_blocks=128, enable_prefix_caching=False)
    for params in (GREEDY, seeded):
        ref = [o.token_ids for o in no_cache.generate(prompts, params)]
        for _ in range(2):         # the second pass finds every prompt's blocks cached
            outs = smol_llm.generate(prompts, params)
            assert [o.token_ids for o in outs] == ref
            check_pool_is_free(smol_llm.engine)
        for p, o in zip(prompts, outs):
            # every full block but the one holding the last prompt token
            assert o.num_cached_tokens == (len(p) - 1) // 16 * 16
    assert smol_llm.stats()["prefix_cache_hit_tokens_total"] > 0
    check_pool_is_free(no_cache.engine)


def test_prefix_cache_evicts_in_a_small_pool():
    """A pool too small to keep every prefix: evictions, preemptions, and still
    the same output as without a cache."""
    ensure_smol()
    tok = ns.load_tokenizer(SMOL_DIR)[0]
    prompts = shared_prefix_prompts(tok)
    small = ns.LLM(SMOL_DIR, device="cpu", num_blocks=14, block_size=8)
    no_cache = ns.LLM(SMOL_DIR, device="cpu", num_blocks=64, block_size=8, enable_prefix_caching=False)
    ref = [o.token_ids for o in no_cache.generate(prompts, GREEDY)]
    for order in (prompts, prompts[::-1], prompts):
        outs = small.generate(order, GREEDY)
        assert [o.token_ids for o in outs] == [ref[prompts.index(p)] for p in order]
        check_pool_is_free(small.engine)
    a = small.engine.allocator
    assert len(a.cached_blocks) == len(a.evictable) <= a.num_blocks
    assert all(a.block_hashes[b] == h for h, b in a.cached_blocks.items())
    assert small.stats()["prefix_cache_hit_tokens_total"] > 0


# ---------------------------------------------------------------------------
# Speculative decoding (nanoserve.py's chapter)

COPY_PROMPTS = ["Copy this line twice: the red fox ran over the hill to the old mill by the river."
                "\nthe red fox ran over the hill", "def area(width, height):\n    return width * "
                "height\n\ndef area(width, height):\n", "1, 2, 3, 4, 5, 6, 1, 2, 3,"]


def test_speculative_greedy_equals_plain(smol_llm):
    """fp32 greedy with drafts gives plain decoding's tokens, batched and alone, with preemptions
    (9 blocks of 8) and with prefix caching (a second pass finds the prompts cached); drafts are
    both accepted and rejected, and every block is back in the pool after all the rewinds."""
    prompts = COPY_PROMPTS + SMOL_PROMPTS[:1]
    params = ns.SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    plain = [o.token_ids for o in smol_llm.generate(prompts, params)]
    spec = ns.LLM(SMOL_DIR, device="cpu", num_blocks=64, num_speculative_tokens=4)
    small = ns.LLM(SMOL_DIR, device="cpu", num_blocks=9, block_size=8, num_speculative_tokens=4,
                   enable_prefix_caching=False)
    for llm in (spec, spec, small):
        assert [o.token_ids for o in llm.generate(prompts, params)] == plain
        check_pool_is_free(llm.engine)
    assert spec.generate(prompts[:1], params)[0].token_ids == plain[0]
    stats = spec.stats()
    assert stats["prefix_cache_hit_tokens_total"] > 0 and small.stats()["preemptions_total"] > 0
    drafted, accepted = (stats[f"spec_decode_num_{k}_tokens_total"] for k in ("draft", "accepted"))
    print(f"drafted {drafted}, accepted {accepted}")
    assert 0 < accepted < drafted


def test_acceptance_keeps_the_sampling_distribution():
    """The rule on a toy model of 3 tokens, p(next | last) a fixed table, one draft per step:
    sample the chunk's 2 rows with the engine's sampler, keep what num_accepted keeps, and the
    first two tokens emitted are distributed as plain sampling's p(a | 0) p(b | a). The draft is
    always token 1 (p(1 | 0) = 0.5): kept half the time, so both branches are exercised."""
    table = torch.tensor([[0.2, 0.5, 0.3], [0.6, 0.1, 0.3], [0.3, 0.3, 0.4]])
    n, draft = 60000, 1
    logits = torch.cat([table[0].log().expand(n, 3), table[draft].log().expand(n, 3)])
    x = ns.sample(logits, sampling_batch([1.0] * 2 * n)).view(2, n)   # row 0, then row 1
    # a rejected draft leaves one token, and the next (plain) step samples the second
    follow = ns.sample(table[x[0]].log(), sampling_batch([1.0] * n))
    kept = torch.tensor([ns.num_accepted([draft], [a, b]) for a, b in x.T.tolist()])
    second = torch.where(kept == 1, x[1], follow)
    counts = torch.bincount(x[0] * 3 + second, minlength=9).float() / n
    expected = (table[0][:, None] * table).flatten()
    print(f"kept {kept.float().mean():.3f}, worst |freq - p| {(counts - expected).abs().max():.4f}")
    assert abs(kept.float().mean() - 0.5) < 0.01
    assert torch.allclose(counts, expected, atol=0.01)    # 4 standard deviations at n = 60,000


def test_a_bad_grammar_fails_its_own_request(smol_llm):
    """Offline, a grammar llguidance cannot read, or one that is not a string, is a ValueError
    when the request is added: no step runs it, and the engine serves the next call."""
    good = ns.SamplingParams(temperature=0, max_tokens=4)
    for grammar in ("this is not a grammar %%%", {"type": "object"}):
        bad = ns.SamplingParams(temperature=0, max_tokens=4, grammar=grammar)
        with pytest.raises(ValueError, match="grammar"):
            smol_llm.generate(["Hello", "Hi there"], [good, bad])
        assert not smol_llm.engine.has_unfinished()
    assert len(smol_llm.generate(["Hello"], good)[0].token_ids) == 4


def test_speculation_keeps_stops_lengths_logprobs_grammars(smol_llm):
    """With drafts: a stop string and a stop token end the text where plain decoding ends it,
    max_tokens is never passed though several tokens are accepted at once, every token keeps
    its log-probs, and a JSON grammar's output is plain decoding's."""
    spec = ns.LLM(SMOL_DIR, device="cpu", num_blocks=64, num_speculative_tokens=4)
    prompt = COPY_PROMPTS[0]
    grammar = smol_llm.front.grammar(json.dumps({"type": "object", "properties": {
        "fox": {"type": "string"}}, "required": ["fox"]}))
    cases = [ns.SamplingParams(temperature=0, max_tokens=20, stop=["hill"]),
             ns.SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[smol_llm.front.encode(
                 " mill", add_special_tokens=False)[0]]),
             *[ns.SamplingParams(temperature=0, max_tokens=m, ignore_eos=True, logprobs=2)
               for m in (2, 7)],
             ns.SamplingParams(temperature=0, max_tokens=16, grammar=grammar)]
    for params in cases:
        ref, out = smol_llm.generate([prompt], params)[0], spec.generate([prompt], params)[0]
        assert (out.token_ids, out.text, out.finish_reason) == \
            (ref.token_ids, ref.text, ref.finish_reason), params
        assert len(out.token_ids) <= params.max_tokens
        for (a, top_a), (b, top_b) in zip(out.logprobs, ref.logprobs):
            assert abs(a - b) < 1e-4 and top_a.keys() == top_b.keys()
        assert len(out.logprobs) == (len(out.token_ids) if params.logprobs else 0)
    assert spec.stats()["spec_decode_num_accepted_tokens_total"] > 0
    check_pool_is_free(spec.engine)


def test_stops_inside_an_accepted_run_cut_the_tokens(smol_llm):
    """A stop string, a stop token or max_tokens that falls inside a run of accepted drafts ends
    the output where plain decoding ends it: the tokens, their log-probs and the usage count too,
    not only the text. The stop string "old" here ends inside a 4-draft run."""
    spec = ns.LLM(SMOL_DIR, device="cpu", num_blocks=64, num_speculative_tokens=4)
    prompt = COPY_PROMPTS[0]
    old = smol_llm.front.encode(" old", add_special_tokens=False)[0]
    cases = [dict(stop=["old"], logprobs=1), dict(stop_token_ids=[old]),
             dict(max_tokens=3, ignore_eos=True)]
    for case in cases:
        params = ns.SamplingParams(**{"temperature": 0, "max_tokens": 24, **case})
        ref = smol_llm.generate([prompt], params)[0]
        before = spec.stats()["spec_decode_num_accepted_tokens_total"]
        out = spec.generate([prompt], params)[0]
        assert spec.stats()["spec_decode_num_accepted_tokens_total"] > before, case
        print(case, [smol_llm.front.decode([t]) for t in out.token_ids])
        assert (out.token_ids, out.text, out.finish_reason) == \
            (ref.token_ids, ref.text, ref.finish_reason), case
        assert len(out.logprobs) == len(ref.logprobs)
    check_pool_is_free(spec.engine)


def test_stop_string_cuts_tokens_that_arrive_together(smol_llm):
    """Behind the server several steps' outputs may reach the front end at once. The tokens after
    the one that completes a stop string are dropped with their log-probs, as one at a time."""
    front = smol_llm.front
    ids = front.encode(" to the old mill by the", add_special_tokens=False)
    params = ns.SamplingParams(temperature=0, max_tokens=24, stop=["old"], logprobs=0)
    request = front.add([1, 2], params)
    outs = [ns.DefaultEngineCoreOutput(request.request_id, t, logprobs=(-0.5, {t: -0.5})) for t in ids]
    (state,), stopped = front.process(outs)
    assert stopped == [request.request_id] and state.finish_reason == "stop"
    assert state.text == " to the " and state.token_ids == ids[:3] and len(state.logprobs) == 3


# Each emoji is several tokens, so a step's text often ends mid-character.
EMOJI_PROMPT = "Repeat: 🍎 apple 🍌 banana 🍒 cherry 🍎 apple 🍌 banana 🍒 cherry\n🍎 apple 🍌"
EMOJI_STOPS = [["zzz"], ["🍒"], ["apple"]]      # never matches; a split character; a word


def test_drafts_keep_text_that_ends_mid_character(smol_llm):
    """With drafts, several tokens arrive at once, and their text may end inside a character.
    Only that character waits: the text, tokens, log-probs and finish_reason equal plain
    decoding's for each stop string. A stop string that never matches leaves the whole text,
    as decode gives it without one (the held-back end is released when the request ends)."""
    spec = ns.LLM(SMOL_DIR, device="cpu", num_blocks=64, num_speculative_tokens=4)
    whole = smol_llm.generate(EMOJI_PROMPT, ns.SamplingParams(temperature=0, max_tokens=24))[0]
    assert "\ufffd" in smol_llm.front.decode(whole.token_ids[:2]), "no split character"
    for stop in EMOJI_STOPS:
        params = ns.SamplingParams(temperature=0, max_tokens=24, stop=stop, logprobs=0)
        ref, out = smol_llm.generate(EMOJI_PROMPT, params)[0], spec.generate(EMOJI_PROMPT, params)[0]
        print(stop, repr(ref.text), repr(out.text))
        assert (out.text, out.token_ids, out.finish_reason) == \
            (ref.text, ref.token_ids, ref.finish_reason), stop
        assert [lp for lp, _ in out.logprobs] == pytest.approx([lp for lp, _ in ref.logprobs],
                                                                abs=1e-4)
    assert smol_llm.generate(EMOJI_PROMPT, ns.SamplingParams(
        temperature=0, max_tokens=24, stop=["zzz"]))[0].text == whole.text
    assert spec.stats()["spec_decode_num_accepted_tokens_total"] > 0
    check_pool_is_free(spec.engine)


def test_stop_strings_whatever_the_tokens_per_call(smol_llm):
    """Behind the server a call of FrontEnd.process may bring any number of tokens (steps
    batched, accepted drafts). The text, tokens, log-probs and finish_reason are the same
    whatever the split: one token a call, or runs of 2 to 7 that end mid-character."""
    front, rng = smol_llm.front, random.Random(0)
    ids = smol_llm.generate(EMOJI_PROMPT, ns.SamplingParams(temperature=0, max_tokens=24))[0]
    ids = ids.token_ids

    def run(stop, sizes):
        request = front.add([1, 2], ns.SamplingParams(max_tokens=len(ids), stop=stop, logprobs=0))
        outs = [ns.DefaultEngineCoreOutput(request.request_id, t, logprobs=(-i, {t: -i}))
                for i, t in enumerate(ids)]
        outs[-1].finish_reason = "length"
        start, state = 0, None
        for n in sizes:
            changed, _ = front.process(outs[start:start + n])
            state, start = changed[0] if changed else state, start + n
            if state is not None and state.finish_reason is not None:
                break
        return state.text, state.token_ids, state.logprobs, state.finish_reason

    for stop in EMOJI_STOPS:
        one_at_a_time = run(stop, [1] * len(ids))
        print(stop, one_at_a_time[0], len(one_at_a_time[1]))
        for _ in range(20):
            assert run(stop, [rng.randint(2, 7) for _ in ids]) == one_at_a_time, stop


def test_seeded_draws_ignore_drafts_and_batch(smol_llm):
    """A seeded row's draws depend on its seed and the token's position only: the same output
    alone, beside 17 other requests, and with drafts on or off."""
    spec = ns.LLM(SMOL_DIR, device="cpu", num_blocks=256, num_speculative_tokens=4)
    p = ns.SamplingParams(temperature=0.8, max_tokens=24, seed=1234, ignore_eos=True)
    prompt = COPY_PROMPTS[0]
    off = smol_llm.generate([prompt], p)[0].token_ids
    others = [ns.SamplingParams(temperature=0.8, max_tokens=24, seed=i) for i in range(17)]
    for follows in (False, True):        # a drafting step read back first, or followed (GPU)
        spec.engine.scheduler.speculation.follows_on_device = follows
        alone = spec.generate([prompt], p)[0].token_ids
        batched = spec.generate(COPY_PROMPTS * 6, [p] + others)[0].token_ids
        print(smol_llm.front.decode(alone))
        assert alone == batched == off
    assert spec.stats()["spec_decode_num_accepted_tokens_total"] > 0
    check_pool_is_free(spec.engine)


def test_drafts_never_starve_a_running_row(smol_llm, monkeypatch):
    """Drafts take only the budget left after every running row has its token. With 2 seats, a
    budget of 4 tokens and 3 drafts that are always right, the second request still gets a token
    in every step while the first one runs."""
    params = ns.SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = [smol_llm.front.encode(p) for p in COPY_PROMPTS[:2]]
    ref = [o.token_ids for o in smol_llm.generate(prompts, params)]
    wanted = [p + r for p, r in zip(prompts, ref)]
    monkeypatch.setattr(ns.NgramIndex, "propose", lambda self, token_ids, k: next(
        w for w in wanted if w[:len(token_ids)] == token_ids)[len(token_ids):len(token_ids) + k])
    spec = ns.LLM(SMOL_DIR, device="cpu", num_blocks=64, max_num_seqs=2,
                  max_num_batched_tokens=4, num_speculative_tokens=3)
    states = [spec.add(p, params) for p in prompts]
    seen, got = [0, 0], []                      # per step: whether each request got a token
    for _ in spec.run():
        now = [len(s.token_ids) for s in states]
        got.append([a > b for a, b in zip(now, seen)])
        seen = now
    first_b = next(i for i, g in enumerate(got) if g[1])
    last_a = max(i for i, g in enumerate(got) if g[0])
    print(f"{len(got)} steps; the second request's first token in step {first_b}, the first's "
          f"last in step {last_a}")
    assert first_b < last_a and all(g == [True, True] for g in got[first_b:last_a + 1])
    assert [s.token_ids for s in states] == ref
    assert spec.stats()["spec_decode_num_accepted_tokens_total"] > 0
    check_pool_is_free(spec.engine)


def test_drafts_keep_the_one_ahead_overlap(smol_llm):
    """No step reads the step before back before it launches the next, with drafts on and rows
    following them on the device (as on a GPU): not for rows that cannot draft (a penalty),
    which draft nothing, nor for rows that draft and keep drafts. A read-back-first step is one
    whose step before is read while it is still the last launched."""
    spec = ns.LLM(SMOL_DIR, device="cpu", num_blocks=64, num_speculative_tokens=4)
    spec.engine.scheduler.speculation.follows_on_device = True    # as on a GPU
    engine, read_first = spec.engine, []
    commit = engine._commit
    def spy(step):
        read_first.append(engine.launched is step)
        return commit(step)
    engine._commit = spy
    penalized = ns.SamplingParams(temperature=0, max_tokens=16, presence_penalty=0.5)
    spec.generate(COPY_PROMPTS, penalized)
    assert len(read_first) > 10 and not any(read_first)
    assert spec.stats()["spec_decode_num_draft_tokens_total"] == 0
    read_first.clear()
    spec.generate(COPY_PROMPTS, ns.SamplingParams(temperature=0, max_tokens=16))
    assert len(read_first) > 5 and not any(read_first)
    assert spec.stats()["spec_decode_num_accepted_tokens_total"] > 0
    check_pool_is_free(engine)


@pytest.mark.parametrize("device,eager", [
    ("cpu", True), *[pytest.param("cuda", e, marks=pytest.mark.skipif(not CUDA, reason="needs CUDA"))
                     for e in (False, True)]])
def test_any_drafts_keep_fp32_greedy(tiny, device, eager, monkeypatch):
    """fp32 greedy output is plain decoding's whatever the drafts: on a random model (which copies
    nothing, so prompt lookup would rarely draft), drafts from the plain output itself with every
    third token wrong, so runs of them are kept and rejected. On the GPU with CUDA graphs and
    eager; batched and alone; every block back after the rewinds."""
    path, _ = tiny
    prompts = [list(range(5, 25)) * 2, [9, 8, 7, 6] * 8, list(range(100, 164))]
    params = ns.SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    settings = dict(device=device, dtype="float32", enforce_eager=eager, num_blocks=128,
                    block_size=8, max_num_batched_tokens=256, max_num_seqs=8)
    plain = ns.LLM(path, **settings)
    ref = [o.token_ids for o in plain.generate(prompts, params)]
    del plain
    wanted = {tuple(p): p + r for p, r in zip(prompts, ref)}     # prompt -> its whole sequence

    def oracle(self, token_ids, k):          # the true next tokens, every third one wrong
        whole = next(w for p, w in wanted.items() if tuple(token_ids[:len(p)]) == p)
        n = len(token_ids)
        return [t if (n + i) % 3 else (t + 1) % 512 for i, t in enumerate(whole[n:n + k])]
    monkeypatch.setattr(ns.NgramIndex, "propose", oracle)
    spec = ns.LLM(path, num_speculative_tokens=4, **settings)
    for follows in (False, True):   # on the CPU too, rows may follow drafts on the device
        spec.engine.scheduler.speculation.follows_on_device = follows or device == "cuda"
        assert [o.token_ids for o in spec.generate(prompts, params)] == ref
        assert [spec.generate([p], params)[0].token_ids for p in prompts] == ref
    stats = spec.stats()
    drafted, accepted = (stats[f"spec_decode_num_{k}_tokens_total"] for k in ("draft", "accepted"))
    print(f"{device} eager {eager}: drafted {drafted}, accepted {accepted}")
    assert 0 < accepted < drafted
    check_pool_is_free(spec.engine)


def test_num_speculative_tokens_bounds(capsys):
    """Negative or above 15: a ValueError from LLM (before loading), one line from the CLI."""
    ensure_smol()
    for k in (-1, 16):
        with pytest.raises(ValueError, match=f"num_speculative_tokens must be in \\[0, 15\\], "
                                             f"got {k}"):
            ns.LLM(SMOL_DIR, device="cpu", num_speculative_tokens=k)
        with pytest.raises(SystemExit) as e:
            ns.main(["generate", "Hi", "--device", "cpu", "--num-speculative-tokens", str(k)])
        assert str(e.value.code).startswith("error: num_speculative_tokens") and \
            "\n" not in str(e.value.code)


def test_generate_on_first_use_prints_the_answer_alone_on_stdout(smol_llm, tmp_path, monkeypatch,
                                                                   capfd):
    """`nanoserve.py generate` with no default model yet makes it (download.py) into a temporary
    folder here. pip's and the converter's progress go to stderr, stdout holds the answer alone,
    and stderr ends with one line of speed (with drafts on, their acceptance)."""
    prompt, folder = "The capital of France is", str(tmp_path / download.DEFAULT_NAME)
    [want] = smol_llm.generate(prompt, ns.SamplingParams(temperature=0, max_tokens=8))
    real = download.download
    monkeypatch.setattr(download, "download", lambda: real(root=tmp_path))
    monkeypatch.setattr(ns, "DEFAULT_MODEL", folder)
    ns.main(["generate", prompt, "--model", folder, "--device", "cpu", "--temperature", "0",
             "--max-tokens", "8", "--num-speculative-tokens", "4"])
    out, err = capfd.readouterr()
    print(err)
    assert out == want.text + "\n" and "[4/4] wrote" in err
    assert re.fullmatch(r"8 tokens in [0-9.]+ s \(first token after [0-9.]+ s\), decode [0-9.]+ "
                        r"tok/s, \d+ of \d+ drafts accepted \(\d+%\)", err.splitlines()[-1]), \
        err.splitlines()[-1]


def test_speed_line_counts_the_decode_alone():
    """generate's speed: the first token's wait (the prefill, and a first run's warm-up) is told
    apart, and decode tok/s counts the 7 tokens after it over the 0.28 s after it."""
    llm = types.SimpleNamespace(front=types.SimpleNamespace(
        cfg=types.SimpleNamespace(num_speculative_tokens=0)))
    state = types.SimpleNamespace(token_ids=[1] * 8, arrival_time=10.0, first_token_time=10.52,
                                  finish_time=10.80)
    assert ns.speed_line(llm, state) == "8 tokens in 0.80 s (first token after 0.52 s), decode 25.0 tok/s"
    state.token_ids, state.finish_time = [1], 10.52
    assert ns.speed_line(llm, state) == "1 tokens in 0.52 s (first token after 0.52 s)"

# ---------------------------------------------------------------------------
# Sampling

def sampling_batch(temps, top_ks=None, top_ps=None, gens=()):
    B = len(temps)
    return ns.SamplingBatch(
        temperatures=torch.tensor(temps, dtype=torch.float32),
        top_ks=torch.tensor(top_ks or [10 ** 6] * B), top_ps=torch.tensor(top_ps or [1.0] * B),
        generators=list(gens), all_greedy=all(t == 0 for t in temps),
        needs_top_k_top_p=top_ks is not None or top_ps is not None)


def test_top_k_top_p_masks_are_exact():
    logits = torch.tensor([[1.0, 4.0, 3.0, 2.0, 0.0],
                           [1.0, 4.0, 3.0, 2.0, 0.0],
                           [0.0, 0.0, 0.0, 5.0, 0.0]])
    top_ks = torch.tensor([2, 5, 5])
    # probs of row 1 sorted: .644 .237 .087 .032 .012; p=0.85 keeps the top two
    top_ps = torch.tensor([1.0, 0.85, 0.5])
    masked = pa.apply_top_k_top_p(logits, top_ks, top_ps)
    kept = torch.isfinite(masked)
    assert kept.tolist() == [[False, True, True, False, False],
                             [False, True, True, False, False],
                             [False, False, False, True, False]]
    assert torch.equal(masked[kept], logits[kept])    # survivors are untouched


def test_seeded_sampling_is_reproducible(smol_llm):
    p = ns.SamplingParams(temperature=1.0, top_p=0.95, max_tokens=16, seed=1234, ignore_eos=True)
    alone = smol_llm.generate(["Tell me a story"], p)[0].token_ids
    others = ns.SamplingParams(temperature=0.8, max_tokens=16, ignore_eos=True)
    in_batch = smol_llm.generate(["Hello", "Tell me a story", "Why"], [others, p, others])
    assert in_batch[1].token_ids == alone
    other_seed = smol_llm.generate(["Tell me a story"], ns.SamplingParams(
        temperature=1.0, top_p=0.95, max_tokens=16, seed=4321, ignore_eos=True))[0]
    assert other_seed.token_ids != alone


def test_sampled_frequencies_match_softmax():
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])
    n, temperature = 40000, 0.7
    batch = sampling_batch([temperature] * n)
    torch.manual_seed(0)
    tokens = ns.sample(logits.expand(n, -1).clone(), batch)
    freq = torch.bincount(tokens, minlength=5).float() / n
    expected = (logits / temperature).softmax(-1)
    sigma = (expected * (1 - expected) / n).sqrt()
    worst = ((freq - expected).abs() / sigma).max().item()
    print(f"sampled frequencies {freq.tolist()}, expected {expected.tolist()}, worst {worst:.1f} sigma")
    assert worst < 5


def test_two_level_argmax_equals_argmax():
    """Ties go to the first index, vocabularies that 64 does not divide fall
    back, and bf16 rows give the same ids as torch.argmax."""
    for V in (49152, 128256, 1000):
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(5, V).to(dtype)
            x[1, 7] = x[1, 70000 % V] = x[3, V - 1] = 100.0   # a tie in row 1
            assert torch.equal(pa.argmax_rows(x), x.argmax(-1))


def test_greedy_rows_ignore_noise():
    logits = torch.randn(6, 50)
    batch = sampling_batch([0, 1.0, 0, 1.0, 0, 0.5])
    tokens = ns.sample(logits, batch)
    greedy = logits.argmax(-1)
    assert tokens[[0, 2, 4]].tolist() == greedy[[0, 2, 4]].tolist()


# -- logit_bias and the penalties --

def launched_step(seqs, logits):
    """A step as ModelRunner.launch leaves it, for these rows' logits (each draws position 0)."""
    return ns.LaunchedStep(None, seqs, logits, [0] * len(seqs))


def history_seqs(V, specs, gen):
    """Sequences with a random prompt and output from a small id range (so
    tokens repeat), one per SamplingParams in specs."""
    seqs = []
    for i, params in enumerate(specs):
        ids = torch.randint(0, 60, (30,), generator=gen).tolist()
        seq = ns.Sequence(f"r{i}", ids[:18], params)
        seq.token_ids += ids[18:]                      # 12 generated tokens
        ns.check_logit_params(params, V)
        seqs.append(seq)
    return seqs


def reference_edits(logits, seqs):
    """Each formula as written: OpenAI's logit_bias, transformers' repetition
    penalty over prompt and output, OpenAI's frequency and presence penalties
    over the output."""
    ref, V = logits.clone(), logits.shape[1]
    for row, seq in enumerate(seqs):
        p, x = seq.params, ref[row]
        for t, b in p.logit_bias.items():
            x[t] += b
        seen = torch.zeros(V, dtype=torch.bool)
        seen[seq.token_ids] = True
        x[:] = torch.where(seen, torch.where(x < 0, x * p.repetition_penalty,
                                             x / p.repetition_penalty), x)
        counts = torch.bincount(torch.tensor(seq.token_ids[seq.num_prompt_tokens:]),
                                minlength=V).float()
        x -= counts * p.frequency_penalty + (counts > 0).float() * p.presence_penalty
    return ref


def test_logit_bias_and_penalties_match_their_formulas(smol_llm):
    runner, gen = smol_llm.engine.runner, torch.Generator().manual_seed(3)
    V = runner.cfg.vocab_size
    logits = torch.randn(7, V, generator=gen) * 3
    logits[:, :60] += 2.0        # the seen ids hold the largest logits, positive and negative
    G = lambda **kw: ns.SamplingParams(temperature=0, **kw)           # noqa: E731
    top = logits.argmax(-1).tolist()
    specs = {"plain": G(), "logit_bias": G(logit_bias={str(top[1]): -100, "7": 5.5}),
             "presence_penalty": G(presence_penalty=1.5),
             "frequency_penalty": G(frequency_penalty=-0.7),
             "repetition_penalty": G(repetition_penalty=1.3),
             "all": G(logit_bias={"3": 100}, presence_penalty=-2, frequency_penalty=2,
                      repetition_penalty=0.6),
             "plain, sampled": ns.SamplingParams(temperature=0.8, seed=5)}
    seqs = history_seqs(V, list(specs.values()), gen)
    edits = ns.logit_edits(seqs, runner.device)
    ours, ref = pa.apply_logit_edits(logits, edits), reference_edits(logits, seqs)
    for row, name in enumerate(specs):
        diff = (ours[row] - ref[row]).abs().max().item()
        changed = (ref[row] != logits[row]).sum().item()
        print(f"{name}: {changed} logits changed, worst abs diff {diff:.1e} (tolerance 1e-5)")
        assert diff <= 1e-5 and (changed > 0) == ("plain" not in name)
    tokens = runner.draw(logits, launched_step(seqs, logits))     # the edits, then the draw
    greedy = [r for r, name in enumerate(specs) if name != "plain, sampled"]
    assert tokens[greedy].tolist() == ref[greedy].argmax(-1).tolist()
    assert tokens[1] != top[1]                        # -100 on the greedy token moves it


def test_edited_rows_leave_the_others_alone(smol_llm):
    """Rows without logit_bias or penalties give bitwise the same tokens and
    log-probs whether or not edited rows share their batch, and a batch with
    no edited row builds no edit tensors."""
    runner, gen = smol_llm.engine.runner, torch.Generator().manual_seed(4)
    V = runner.cfg.vocab_size
    plain = [ns.SamplingParams(temperature=0, logprobs=2),
             ns.SamplingParams(temperature=0.9, top_p=0.8, seed=11, logprobs=2),
             ns.SamplingParams(temperature=1.0, top_k=20, seed=12, logprobs=2)]
    edited = [ns.SamplingParams(temperature=0, logit_bias={"1": 50}, logprobs=2),
              ns.SamplingParams(temperature=0.9, repetition_penalty=1.2, presence_penalty=1,
                                seed=13, logprobs=2)]
    seqs = history_seqs(V, plain + edited, gen)
    logits = torch.randn(5, V, generator=gen)
    order = [3, 0, 4, 1, 2]                           # edited rows first and between
    outs = []
    for rows in ([0, 1, 2], order):
        for s in seqs:
            s.generator = torch.Generator().manual_seed(s.params.seed or 0)
        step = launched_step([seqs[r] for r in rows], logits[rows])
        assert (ns.logit_edits(step.seqs, runner.device) is None) == (rows == [0, 1, 2])
        runner.sample(step)                # tokens, then their log-probs, into step.host
        tokens, lp, top_lp, top_ids = step.host
        keep = [rows.index(r) for r in (0, 1, 2)]
        outs.append([t[keep] for t in (tokens, lp, top_lp, top_ids)])
    for alone, mixed in zip(*outs):
        assert torch.equal(alone, mixed)


def test_logit_bias_and_repetition_penalty_in_the_engine(smol, smol_llm):
    """Greedy with -100 on the greedy token picks another one; greedy with a
    repetition penalty matches transformers' generate with the same penalty."""
    _, hf = smol
    prompt = SMOL_PROMPTS[3]
    base = smol_llm.generate([prompt], ns.SamplingParams(temperature=0, max_tokens=1))[0]
    biased = ns.SamplingParams(temperature=0, max_tokens=1,
                               logit_bias={str(base.token_ids[0]): -100})
    outs = smol_llm.generate([prompt, SMOL_PROMPTS[0]], [biased, GREEDY])
    assert outs[0].token_ids[0] != base.token_ids[0]
    assert outs[1].token_ids == smol_llm.generate([SMOL_PROMPTS[0]], GREEDY)[0].token_ids
    # (penalized rows count each step's token on the host: a step is sampled
    # once the step before has been read back, see EngineCore.step)
    ids = smol_llm.front.tokenizer.encode(prompt).ids
    params = ns.SamplingParams(temperature=0, max_tokens=20, ignore_eos=True,
                               repetition_penalty=1.3)
    out = smol_llm.generate([ids], params)[0].token_ids
    ref = hf.generate(torch.tensor([ids]), max_new_tokens=20, min_new_tokens=20, do_sample=False,
                      repetition_penalty=1.3, eos_token_id=None, pad_token_id=0,
                      attention_mask=torch.ones(1, len(ids), dtype=torch.long))
    print("repetition_penalty 1.3:", smol_llm.front.decode(out))
    assert out == ref[0, len(ids):].tolist()
    assert out != smol_llm.generate([ids], GREEDY)[0].token_ids
    check_pool_is_free(smol_llm.engine)


def test_sampling_params_errors_name_the_field():
    cases = [dict(presence_penalty=2.5), dict(frequency_penalty=-3),
             dict(repetition_penalty=0), dict(repetition_penalty=float("nan")),
             dict(prompt_logprobs=21), dict(logit_bias={"a": 1}), dict(logit_bias=[1, 2]),
             dict(logit_bias={"5": 101}), dict(logit_bias={"1000": 1}),
             dict(logit_bias={"-1": 1}), dict(logit_bias={"5": 10 ** 400})]
    for kw in cases:
        with pytest.raises(ValueError, match="^" + next(iter(kw))):
            ns.check_logit_params(ns.SamplingParams(**kw), vocab_size=1000)
    p = ns.SamplingParams(logit_bias={"5": -100, 6: 1}, presence_penalty=-2,
                          repetition_penalty=1.5)
    ns.check_logit_params(p, vocab_size=1000)
    assert p.logit_bias == {5: -100.0, 6: 1.0} and p.needs_output_history
    assert not ns.SamplingParams(logit_bias={"5": 1}).needs_output_history


def test_tiny_temperatures_decode_greedily(smol_llm):
    """A temperature below 1e-5 is greedy: 1e-40, a denormal, overflowed logits / t to inf, and
    the softmax's NaN drew no token of the text (empty output), where 1e-20 decoded greedily."""
    greedy = smol_llm.generate("The capital of France is", ns.SamplingParams(
        temperature=0, max_tokens=8))[0].token_ids
    for t in (1e-40, 1e-20, 1e-6):
        out = smol_llm.generate("The capital of France is", ns.SamplingParams(
            temperature=t, max_tokens=8, ignore_eos=True))[0]
        print(t, out.token_ids)
        assert out.token_ids == greedy


def test_a_bad_seed_is_refused_before_anything_is_queued(smol_llm):
    """A seed that torch.Generator.manual_seed does not take (out of its range, or not an int)
    is checked with the other sampling parameters: generate refuses it, naming the range, before
    it queues any request. The range's ends are taken."""
    good = ns.SamplingParams(temperature=0, max_tokens=2)
    for seed in (2 ** 64, -2 ** 63 - 1, 1.5, True):
        with pytest.raises(ValueError, match=r"^seed must be an integer from -2\*\*63 to "
                                             r"2\*\*64 - 1"):
            smol_llm.generate(["Hello", "Hi"], [good, ns.SamplingParams(max_tokens=2, seed=seed)])
        assert not smol_llm.engine.has_unfinished() and not smol_llm.front.states, seed
    ends = [ns.SamplingParams(max_tokens=2, seed=seed) for seed in (-2 ** 63, 2 ** 64 - 1)]
    assert [len(o.token_ids) for o in smol_llm.generate(["Hello", "Hi"], ends)] == [2, 2]
    check_pool_is_free(smol_llm.engine)


# ---------------------------------------------------------------------------
# Prompt log-probs (what log-likelihood evaluations read)

def run_to_end(llm, prompts, params):
    """The finished requests, which hold the prompt log-probs."""
    return llm.generate(prompts, params)


def test_prompt_logprobs_match_transformers(smol):
    """Every prompt token's log-prob and top-3 equal transformers' log_softmax
    (fp32, 1e-4), whether the prompt is prefilled whole, in chunks of 16
    tokens mixed with another request and with its prefix in the cache (which
    such a request must bypass), or recomputed after a preemption."""
    path, hf = smol
    tok = ns.load_tokenizer(path)[0]
    prompt = tok.encode("The quick brown fox jumps over the lazy dog. " * 5).ids   # 50 tokens
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0, :-1].float().log_softmax(-1)  # (T - 1, V)
    want, top_ref = ref.gather(1, torch.tensor(prompt[1:])[:, None])[:, 0], ref.topk(3)
    params = ns.SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=3, ignore_eos=True)
    whole = ns.LLM(path, device="cpu", num_blocks=64)
    chunked = ns.LLM(path, device="cpu", num_blocks=64, max_num_batched_tokens=16, max_num_seqs=4)
    small = ns.LLM(path, device="cpu", num_blocks=7, block_size=8, max_num_batched_tokens=16,
                   max_num_seqs=4)     # the prompt needs all 7 blocks: it is preempted
    run_to_end(chunked, [prompt[:40]], GREEDY)
    assert chunked.engine.allocator.lookup(ns.prefix_hash(None, prompt[:16])) is not None
    cases = {"whole": run_to_end(whole, [prompt], params)[0],
             "chunked, cache bypassed": run_to_end(chunked, [prompt, SMOL_PROMPTS[0]], params)[0],
             "preempted": run_to_end(small, [SMOL_PROMPTS[0], prompt], [GREEDY, params])[1]}
    assert small.stats()["preemptions_total"] > 0
    assert chunked.stats()["prefix_cache_hit_tokens_total"] == 0  # not served from the cache
    for name, seq in cases.items():
        assert len(seq.prompt_logprobs) == len(prompt) - 1
        got = torch.tensor([lp for lp, _ in seq.prompt_logprobs])
        top_ids = torch.tensor([list(top) for _, top in seq.prompt_logprobs])
        top_lp = torch.tensor([list(top.values()) for _, top in seq.prompt_logprobs])
        diff = max((got - want).abs().max().item(), (top_lp - top_ref.values).abs().max().item())
        vs_whole = max(abs(a[0] - b[0]) for a, b in zip(seq.prompt_logprobs,
                                                        cases["whole"].prompt_logprobs))
        print(f"prompt log-probs, {name}: worst abs diff {diff:.1e} (tolerance 1e-4), "
              f"{vs_whole:.1e} from whole prefill (tolerance 5e-5: fp32 rounding)")
        assert diff <= 1e-4 and vs_whole <= 5e-5 and torch.equal(top_ids, top_ref.indices)
    for llm in (whole, chunked, small):
        check_pool_is_free(llm.engine)


# ---------------------------------------------------------------------------
# Block allocator

def test_allocator_counts_and_evicts_lru():
    a = ns.PrefixCachingAllocator(4)
    blocks = [a.allocate() for _ in range(4)]
    assert a.num_free_blocks == 0
    with pytest.raises(AssertionError):
        a.free(blocks[0]); a.free(blocks[0])           # noqa: E702  (the second is a double free)
    a.cache(blocks[1], 111); a.cache(blocks[2], 222)
    a.free(blocks[2]); a.free(blocks[1])               # 2 is evictable before 1
    a.share(blocks[1]); a.free(blocks[1])              # shared again: now 1 is the most recent
    assert a.lookup(111) == blocks[1] and a.lookup(222) == blocks[2]
    assert a.allocate() == blocks[0]                   # uncached blocks go first
    assert a.allocate() == blocks[2]                   # then the least recently used
    assert a.lookup(222) is None and a.lookup(111) == blocks[1]


# ---------------------------------------------------------------------------
# Bad input

def test_bad_input_is_a_clear_value_error(smol_llm, tmp_path):
    cases = [("", ns.SamplingParams(), "empty"),
             ([], ns.SamplingParams(), "empty"),
             ("hi", ns.SamplingParams(max_tokens=0), "max_tokens"),
             ("hi", ns.SamplingParams(max_tokens=9000), "context window of 8192"),
             ("hi", ns.SamplingParams(temperature=-1), "temperature"),
             ("hi", ns.SamplingParams(top_p=0), "top_p"),
             ([1, 10 ** 9], ns.SamplingParams(), "token ids")]
    for prompt, params, words in cases:
        with pytest.raises(ValueError, match=words):
            smol_llm.generate([prompt], params)
    with pytest.raises(ValueError, match="does not exist"):
        ns.LLM(str(tmp_path / "nope"))
    check_pool_is_free(smol_llm.engine)


def test_a_missing_model_gets_the_hint_for_it(tmp_path, monkeypatch):
    """A missing model folder's error says how to get that model: download.py alone makes the
    default one, and download.py ORG/NAME any other, never the default for another."""
    missing = str(tmp_path / "Llama-3.2-1B")
    with pytest.raises(ValueError) as e:
        Config(model=missing)
    assert "`python download.py ORG/NAME` puts a hub model in weights/NAME" in str(e.value)
    monkeypatch.setattr(ns, "DEFAULT_MODEL", missing)
    with pytest.raises(ValueError, match=r"\(run `python download.py`\)$"):
        Config(model=missing)


def test_fp8_on_the_cpu_says_it_is_slow(capsys):
    """fp8 weights on the CPU run, and one line at start-up says which path and that it is
    slow; the default path says nothing."""
    ensure_smol()
    ns.check_fp8(Config(model=DEFAULT_MODEL, device="cpu", quantization="fp8"))  # Fp8WeightsRunner's
    err = capsys.readouterr().err
    assert err.startswith("fp8 weights on the CPU run the torch reference") and \
        "slower than float32" in err and err.count("\n") == 1, err
    ns.check_fp8(Config(model=DEFAULT_MODEL, device="cpu"))
    assert capsys.readouterr().err == ""


def test_hub_copy_of_the_default_model_gets_its_own_folder(tmp_path, monkeypatch):
    """HuggingFaceTB/SmolLM2-135M-Instruct shares its NAME with the default model's folder, which
    holds the 4-bit rebuild: it goes to NAME-hub, never "complete, nothing to do" (a fake hub)."""
    hub = pytest.importorskip("huggingface_hub")
    (tmp_path / download.DEFAULT_NAME).mkdir()             # the rebuild is there already
    fetched = []

    def snapshot_download(repo_id, local_dir, allow_patterns, ignore_patterns):
        fetched.append(repo_id)
        os.makedirs(local_dir)
        open(os.path.join(local_dir, "model.safetensors"), "wb").close()

    monkeypatch.setattr(hub, "snapshot_download", snapshot_download)
    out = download.download("HuggingFaceTB/SmolLM2-135M-Instruct", tmp_path)
    assert out == tmp_path / "SmolLM2-135M-Instruct-hub" and (out / "model.safetensors").is_file()
    assert fetched == ["HuggingFaceTB/SmolLM2-135M-Instruct"]
    assert download.download("meta-llama/Llama-3.2-1B", tmp_path) == tmp_path / "Llama-3.2-1B"


def test_hub_families_fetch_their_transformers_files(tmp_path, monkeypatch):
    """Qwen3, Qwen2.5 and Mistral come from the hub as Llama does (a fake hub that filters as
    the real one): Mistral's copy of its weights in its own format stays behind."""
    import fnmatch
    hub = pytest.importorskip("huggingface_hub")
    repos = {"Qwen/Qwen3-0.6B": ["config.json", "model.safetensors", "merges.txt", "vocab.json"],
             "Qwen/Qwen2.5-0.5B-Instruct": ["config.json", "model.safetensors", "LICENSE"],
             "mistralai/Mistral-7B-Instruct-v0.3": [
                 "config.json", "params.json", "model-00001-of-00003.safetensors",
                 "consolidated.safetensors", "tokenizer.model.v3", "tokenizer.json"]}

    def snapshot_download(repo_id, local_dir, allow_patterns, ignore_patterns):
        os.makedirs(local_dir)
        for name in repos[repo_id]:
            if any(fnmatch.fnmatch(name, p) for p in allow_patterns) and \
                    not any(fnmatch.fnmatch(name, p) for p in ignore_patterns):
                open(os.path.join(local_dir, name), "wb").close()

    monkeypatch.setattr(hub, "snapshot_download", snapshot_download)
    got = {repo: sorted(os.listdir(download.download(repo, tmp_path))) for repo in repos}
    assert got == {"Qwen/Qwen3-0.6B": ["config.json", "merges.txt", "model.safetensors",
                                       "vocab.json"],
                   "Qwen/Qwen2.5-0.5B-Instruct": ["config.json", "model.safetensors"],
                   "mistralai/Mistral-7B-Instruct-v0.3": [
                       "config.json", "model-00001-of-00003.safetensors", "params.json",
                       "tokenizer.json"]}


# ---------------------------------------------------------------------------
# Paged-attention kernels against their torch references. On CPU they run in
# the Triton interpreter (fp32); on a GPU also in bf16.
# Every cache slot that no sequence owns is NaN (spare blocks, the tail of each
# sequence's last block, the blocks that padding entries of the table point
# at), and outputs are pre-filled with NaN, so a kernel that reads past a
# context or skips a row fails the finiteness check instead of passing by luck.

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
NO_CUDA = not torch.cuda.is_available()
DEVICE_DTYPES = pytest.mark.parametrize("device,dtype", [
    pytest.param("cpu", torch.float32,
                 marks=pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1")),
    pytest.param("cuda", torch.float32, marks=pytest.mark.skipif(NO_CUDA, reason="needs CUDA")),
    pytest.param("cuda", torch.bfloat16, marks=pytest.mark.skipif(NO_CUDA, reason="needs CUDA")),
])
# (n_heads, n_kv, hd, block_size): GQA ratios 1, 3 and 4, both head dims, three block sizes
SHAPES = pytest.mark.parametrize("n_heads,n_kv,hd,block_size", [
    (4, 4, 64, 16),
    (9, 3, 128, 8),
    (8, 2, 64, 32),
    (8, 2, 128, 16),
])


def compare(out, ref, dtype, what):
    """fp32: max abs error < 2e-5. bf16: ||out - ref|| / ||ref|| < 1e-2, with ref
    computed in fp32 from the same bf16 inputs."""
    assert torch.isfinite(out).all(), f"{what}: non-finite output (a row not written, or NaN slots read)"
    out, ref = out.float(), ref.float()
    if dtype == torch.float32:
        err = (out - ref).abs().max().item()
        print(f"{what}: max abs err {err:.2e}")
        assert err < 2e-5, f"{what}: max abs err {err:.2e}"
    else:
        err = ((out - ref).norm() / ref.norm()).item()
        print(f"{what}: rel err {err:.2e}")
        assert err < 1e-2, f"{what}: rel err {err:.2e}"


def make_paged_cache(context_lens, block_size, n_kv, hd, dtype, device, gen, extra_cols=1):
    """Random K/V pools and a block table with shuffled block ids.

    extra_cols padding columns widen the table past the longest sequence, as a
    CUDA-graph batch sized for the longest allowed sequence would.
    """
    blocks_per_seq = [-(-L // block_size) for L in context_lens]
    num_blocks = sum(blocks_per_seq) + 2  # two blocks nobody owns
    shape = (num_blocks, block_size, n_kv, hd)
    k_cache = torch.randn(shape, generator=gen)
    v_cache = torch.randn(shape, generator=gen)
    perm = torch.randperm(num_blocks, generator=gen)
    unowned = perm[:2]
    k_cache[unowned] = float("nan")
    v_cache[unowned] = float("nan")
    block_tables = torch.full((len(context_lens), max(blocks_per_seq) + extra_cols), int(unowned[0]))
    first = 2
    for b, (L, nb) in enumerate(zip(context_lens, blocks_per_seq)):
        block_tables[b, :nb] = perm[first:first + nb]
        first += nb
        if L % block_size:  # slots past the end of the last block
            k_cache[block_tables[b, nb - 1], L % block_size:] = float("nan")
            v_cache[block_tables[b, nb - 1], L % block_size:] = float("nan")
    lens = torch.tensor(context_lens, dtype=torch.int32, device=device)
    return k_cache.to(device, dtype), v_cache.to(device, dtype), block_tables.to(device, torch.int32), lens


def fused_qkv_views(N_tok, n_heads, n_kv, hd, dtype, device, gen):
    """q, k, v as the strided views a fused qkv projection hands out."""
    qkv = torch.randn(N_tok, (n_heads + 2 * n_kv) * hd, generator=gen).to(device, dtype)
    q, k, v = qkv.split([n_heads * hd, n_kv * hd, n_kv * hd], dim=1)
    return q.view(N_tok, n_heads, hd), k.view(N_tok, n_kv, hd), v.view(N_tok, n_kv, hd)


def nan_like(x):
    return torch.full(x.shape, float("nan"), dtype=x.dtype, device=x.device)


# ----------------------------------------------------------------------------
# store_kvcache

def random_pool(num_blocks, block_size, n_kv, hd, N_tok, pad_row, dtype, device, gen):
    """A random K/V pool and a distinct slot for each of N_tok new tokens;
    row pad_row is a padding token of a CUDA-graph batch (slot -1)."""
    slot_mapping = torch.randperm(num_blocks * block_size, generator=gen)[:N_tok]
    slot_mapping[pad_row] = -1
    shape = (num_blocks, block_size, n_kv, hd)
    k_cache = torch.randn(shape, generator=gen).to(device, dtype)
    v_cache = torch.randn(shape, generator=gen).to(device, dtype)
    return slot_mapping.to(device), k_cache, v_cache


@DEVICE_DTYPES
@pytest.mark.parametrize("n_kv,hd,block_size", [(3, 64, 8), (2, 128, 16)])
def test_store_kvcache(device, dtype, n_kv, hd, block_size):
    gen = torch.Generator().manual_seed(0)
    N_tok, num_blocks = 9, 4
    _, k, v = fused_qkv_views(N_tok, 2 * n_kv, n_kv, hd, dtype, device, gen)
    slot_mapping, k_cache, v_cache = random_pool(num_blocks, block_size, n_kv, hd, N_tok, 3,
                                                 dtype, device, gen)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    pa.store_kvcache_ref(k, v, k_ref, v_ref, slot_mapping)
    k_before = k_cache.clone()
    pa.store_kvcache(k, v, k_cache, v_cache, slot_mapping)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)
    # exactly the 8 valid slots changed, and each holds its token
    changed = (k_cache != k_before).flatten(2).any(-1).flatten()  # (num_blocks * block_size,)
    written = slot_mapping[slot_mapping >= 0]
    assert changed.nonzero().flatten().sort().values.tolist() == written.sort().values.tolist()
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot >= 0:
            assert torch.equal(k_cache.view(-1, n_kv, hd)[slot], k[t])
            assert torch.equal(v_cache.view(-1, n_kv, hd)[slot], v[t])


# ----------------------------------------------------------------------------
# decode

def run_decode(context_lens, n_heads, n_kv, hd, block_size, device, dtype, extra_cols=1, seed=0,
               decode=pa.paged_attention_decode, kv_dtype=None):
    """kv_dtype: the pool's, when not q's (pa.FP8); the reference reads the same values widened."""
    gen = torch.Generator().manual_seed(seed)
    k_cache, v_cache, block_tables, lens = make_paged_cache(
        context_lens, block_size, n_kv, hd, kv_dtype or dtype, device, gen, extra_cols)
    q, _, _ = fused_qkv_views(len(context_lens), n_heads, n_kv, hd, dtype, device, gen)
    scale = hd ** -0.5
    out = nan_like(q)
    ret = decode(q, k_cache, v_cache, block_tables, lens, scale, out=out)
    assert ret is out
    ref = pa.paged_attention_decode_ref(q.float(), k_cache.float(), v_cache.float(), block_tables,
                                        lens, scale)
    return out, ref


@DEVICE_DTYPES
@SHAPES
def test_decode(device, dtype, n_heads, n_kv, hd, block_size):
    bs = block_size
    context_lens = [0, 1, bs - 1, bs, bs + 1, 67, 131]  # 0: padding row of a CUDA-graph batch
    out, ref = run_decode(context_lens, n_heads, n_kv, hd, bs, device, dtype)
    assert (out[0] == 0).all(), "a context_len 0 row must come out as zeros"
    compare(out, ref, dtype, f"decode {n_heads}/{n_kv} hd{hd} bs{bs}")


@DEVICE_DTYPES
def test_decode_many_splits(device, dtype):
    """A table far wider than the contexts (as under a CUDA graph sized for the
    longest allowed sequence): many splits, most of them empty."""
    n_heads, n_kv, hd, bs = 4, 1, 64, 16
    out, ref = run_decode([300, 0, 5], n_heads, n_kv, hd, bs, device, dtype, extra_cols=40)
    num_splits = pa._decode_num_splits(3, n_kv, -(-(19 + 40) * bs // pa.DECODE_BLOCK_N), out.device)
    assert num_splits >= 4, "this test is meant to exercise splitting"
    compare(out, ref, dtype, f"decode {num_splits} splits")


@DEVICE_DTYPES
def test_decode_last_split_merges(device, dtype):
    """Sequences with all splits active, two, and none (a padding row) in one
    launch: the last split of each to finish merges them, and leaves its
    arrival count at 0 for the next launch (run twice, other draws)."""
    n_heads, n_kv, hd, bs = 4, 1, 64, 16
    context_lens = [1000, 130, 0]
    num_splits = pa._decode_num_splits(3, n_kv, -(-(63 + 1) * bs // pa.DECODE_BLOCK_N),
                                       torch.device(device))
    assert num_splits >= 8, "the longest context must spread over every split"
    for seed in (0, 1):
        out, ref = run_decode(context_lens, n_heads, n_kv, hd, bs, device, dtype, seed=seed)
        assert (out[2] == 0).all(), "a context_len 0 row must come out as zeros"
        compare(out, ref, dtype, f"decode {num_splits} splits, merged by the last")
        assert (pa._split_k_counts(out.device) == 0).all(), "arrival counts not reset"


# ----------------------------------------------------------------------------
# prefill

def run_prefill_mixed(n_heads, n_kv, hd, bs, device, dtype, prefill=pa.paged_attention_prefill,
                      pad=(0, 0), kv_dtype=None):
    """Whole prefills, chunked prefills after a cached prefix, and decode rows in
    one batch; pad = (rows, sequences) of padding, as a CUDA graph's batch has:
    query rows past the last sequence, and sequences with no rows or context."""
    q_and_context_lens = [
        (67, 67), (bs + 1, bs + 1),        # whole prefills
        (20, 131), (bs - 1, 2 * bs + 3),   # chunks after a cached prefix
        (5, 2 * bs),                       # a chunk ending on a block boundary
        (1, 1), (1, 67), (1, bs),          # decode rows
    ]
    q_lens = [T for T, _ in q_and_context_lens]
    context_lens = [L for _, L in q_and_context_lens]
    gen = torch.Generator().manual_seed(1)
    k_cache, v_cache, block_tables, lens = make_paged_cache(context_lens, bs, n_kv, hd,
                                                            kv_dtype or dtype, device, gen)
    q, _, _ = fused_qkv_views(sum(q_lens) + pad[0], n_heads, n_kv, hd, dtype, device, gen)
    cu_seqlens_q = torch.tensor([0] + q_lens + [0] * pad[1], device=device).cumsum(0).to(torch.int32)
    block_tables = torch.cat([block_tables, block_tables[:pad[1]]])   # stale ids, never read
    lens = torch.cat([lens, torch.zeros(pad[1], dtype=torch.int32, device=device)])
    scale = hd ** -0.5
    out = nan_like(q)
    ret = prefill(q, k_cache, v_cache, block_tables, cu_seqlens_q, lens, scale, out=out)
    assert ret is out
    ref = pa.paged_attention_prefill_ref(q.float(), k_cache.float(), v_cache.float(), block_tables,
                                         cu_seqlens_q, lens, scale)
    if pad[0]:
        assert out[-pad[0]:].isnan().all(), "a padding row was written"
        out, ref = out[:-pad[0]], ref[:-pad[0]]
    return out, ref


@DEVICE_DTYPES
@SHAPES
def test_prefill_mixed(device, dtype, n_heads, n_kv, hd, block_size):
    out, ref = run_prefill_mixed(n_heads, n_kv, hd, block_size, device, dtype)
    compare(out, ref, dtype, f"prefill {n_heads}/{n_kv} hd{hd} bs{block_size}")


@DEVICE_DTYPES
@pytest.mark.parametrize("n_heads,n_kv,hd", [(8, 2, 64), (9, 3, 128)])
def test_prefill_padded_as_a_graph_batch(device, dtype, n_heads, n_kv, hd):
    """The grid comes from N_tok and B alone: padding rows and padding
    sequences (no rows, no context) add programs that return at once, and
    the real rows come out as without them."""
    out, ref = run_prefill_mixed(n_heads, n_kv, hd, 16, device, dtype, pad=(37, 5))
    compare(out, ref, dtype, f"prefill {n_heads}/{n_kv} hd{hd} with 37 padding rows, 5 sequences")


@DEVICE_DTYPES
def test_prefill_matches_decode(device, dtype):
    """A batch of single-token rows through the prefill kernel equals decode."""
    context_lens = [1, 15, 16, 17, 67]
    out_decode, _ = run_decode(context_lens, 8, 2, 64, 16, device, dtype)
    gen = torch.Generator().manual_seed(0)  # the same draws as run_decode
    k_cache, v_cache, block_tables, lens = make_paged_cache(context_lens, 16, 2, 64, dtype, device, gen)
    q, _, _ = fused_qkv_views(len(context_lens), 8, 2, 64, dtype, device, gen)
    cu_seqlens_q = torch.arange(len(context_lens) + 1, dtype=torch.int32, device=device)
    out = pa.paged_attention_prefill(q, k_cache, v_cache, block_tables, cu_seqlens_q, lens, 64 ** -0.5)
    compare(out, out_decode, dtype, "prefill vs decode")


# ----------------------------------------------------------------------------
# GEMV with its prologues and epilogue, and RoPE fused into the KV store

GEMV_CASES = pytest.mark.parametrize("norm,silu_mul,residual", [
    (False, False, False), (True, False, False), (False, False, True), (False, True, True),
    (True, False, True)])


@DEVICE_DTYPES
@GEMV_CASES
@pytest.mark.parametrize("M,N,K,split_k", [(1, 80, 96, 1), (3, 48, 64, 1), (1, 40, 160, 4), (2, 48, 96, 3)])
def test_gemv(device, dtype, norm, silu_mul, residual, M, N, K, split_k, monkeypatch):
    """Against gemv_ref (F.linear) in fp32 on the same inputs. N and K that are
    not multiples of the tiles exercise the masks; split_k 4 over K = 160 in
    32-column steps leaves the last split empty. Run twice: the split-K
    counts must be back at 0 after each launch."""
    monkeypatch.setattr(pa, "_gemv_config", lambda N, K: (16, 32, split_k, 4))
    check_fused_matmul(pa.gemv, device, dtype, norm, silu_mul, residual, M, N, K, split_k)


def check_fused_matmul(kernel, device, dtype, norm, silu_mul, residual, M, N, K, split_k):
    """kernel (pa.gemv or pa.skinny_matmul) against gemv_ref in fp32 on the same inputs, twice:
    the split-K counts must be back at 0 after each launch."""
    gen = torch.Generator().manual_seed(M * N + K)
    rand = lambda *shape: torch.randn(*shape, generator=gen).to(device, dtype)  # noqa: E731
    x, w = rand(M, 2 * K if silu_mul else K), rand(N, K) / K ** 0.5
    norm_w = rand(K) if norm else None
    res = rand(M, N) if residual else None
    up = lambda t: None if t is None else t.float()  # noqa: E731
    ref = pa.gemv_ref(x.float(), w.float(), up(norm_w), 1e-5, silu_mul, up(res))
    for _ in range(2):
        out = nan_like(torch.empty(M, N, dtype=dtype, device=device))
        assert kernel(x, w, norm_w, 1e-5, silu_mul, res, out=out) is out
        compare(out, ref, dtype, f"{kernel.__name__} M={M} N={N} K={K} split {split_k} "
                                 f"norm={norm} silu={silu_mul} res={residual}")
        assert (pa._split_k_counts(out.device) == 0).all(), "split-K counts not reset"


@DEVICE_DTYPES
def test_linear_adds_a_bias(device, dtype):
    """A bias (Qwen2's q, k and v) takes the residual's path in pa.linear, so at batch 1 on the
    GPU the GEMV adds it, read with a row stride of 0. Against F.linear with the bias."""
    gen = torch.Generator().manual_seed(0)
    rand = lambda *shape: torch.randn(*shape, generator=gen).to(device, dtype)  # noqa: E731
    w, b = rand(48, 64) / 8, rand(48)
    for M in (1, 3):
        x = rand(M, 64)
        ref = F.linear(x.float(), w.float(), b.float())
        compare(pa.linear(x, w, bias=b), ref, dtype, f"linear + bias, M={M}")
    compare(pa.gemv(x[:1], w, residual=b.expand(1, -1)), ref[:1], dtype, "gemv + bias")


@pytest.mark.skipif(NO_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("M", [1, 2, 4])
@pytest.mark.parametrize("N,K", [(3072, 2048), (2048, 8192), (128256, 2048)])
def test_gemv_cuda_llama_shapes(M, N, K):
    """Llama-3.2-1B's qkv, down and LM head shapes in bf16 against F.linear."""
    gen = torch.Generator().manual_seed(M)
    x = torch.randn(M, K, generator=gen).to("cuda", torch.bfloat16)
    w = (torch.randn(N, K, generator=gen) / K ** 0.5).to("cuda", torch.bfloat16)
    compare(pa.gemv(x, w), F.linear(x.float(), w.float()), torch.bfloat16, f"gemv {M}x{N}x{K}")


@DEVICE_DTYPES
@GEMV_CASES
@pytest.mark.parametrize("M,N,K,split_k", [(1, 80, 96, 1), (5, 40, 160, 4), (16, 48, 96, 3),
                                           (17, 48, 64, 2)])
def test_skinny_matmul(device, dtype, norm, silu_mul, residual, M, N, K, split_k, monkeypatch):
    """Against gemv_ref (F.linear) in fp32 on the same inputs, as test_gemv: masks, an empty
    last split (4 splits over K = 160 in 32-column steps), 1, 5 and 16 rows in one 16-row
    tile of x and 17 in a 32-row one. Run twice: the split-K counts must be back at 0."""
    monkeypatch.setattr(pa, "_skinny_config", lambda N, K, fp8, M: (16, 32, split_k, 4, 2))
    check_fused_matmul(pa.skinny_matmul, device, dtype, norm, silu_mul, residual, M, N, K, split_k)


@pytest.mark.parametrize("device", [
    pytest.param("cpu", marks=pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1")),
    pytest.param("cuda", marks=pytest.mark.skipif(NO_CUDA, reason="needs CUDA"))])
@pytest.mark.parametrize("M,split_k", [(2, 1), (5, 3), (16, 1)])
def test_skinny_matmul_fp16_norm_does_not_overflow(device, M, split_k, monkeypatch):
    """fp16 rows whose norm_w * x is past fp16's largest value (65,504) while norm_w * x / rms
    is not: the skinny matmul with RMSNorm fused must stay finite and match gemv_ref in fp32."""
    monkeypatch.setattr(pa, "_skinny_config", lambda N, K, fp8, M: (16, 32, split_k, 4, 2))
    gen = torch.Generator().manual_seed(M)
    N, K = 48, 96
    x = (torch.randn(M, K, generator=gen) * 1000).to(device, torch.float16)
    w = (torch.randn(N, K, generator=gen) / K ** 0.5).to(device, torch.float16)
    norm_w = (torch.rand(K, generator=gen) * 100 + 100).to(device, torch.float16)
    assert (norm_w.float() * x.float()).abs().max() > 65504
    ref = pa.gemv_ref(x.float(), w.float(), norm_w.float(), 1e-5)
    compare(pa.skinny_matmul(x, w, norm_w, 1e-5), ref, torch.float16, f"skinny fp16 M={M}")


@pytest.mark.skipif(NO_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("M,N,K", [(2, 3072, 2048), (5, 2048, 2048), (16, 128256, 2048),
                                   (5, 6144, 4096), (16, 1024, 3072), (1, 6144, 4096),
                                   (1, 16384, 2048)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_skinny_matmul_cuda_shapes(M, N, K, dtype):
    """Llama-3.2-1B's qkv, o, LM head and gate_up, Llama-3.1-8B's qkv and Qwen3-0.6B's down
    in bf16 and fp16 (its slices rescaled only where they would overflow), with the tiles
    _skinny_config picks and RMSNorm fused in, against gemv_ref."""
    gen = torch.Generator().manual_seed(M)
    x = torch.randn(M, K, generator=gen).to("cuda", dtype)
    w = (torch.randn(N, K, generator=gen) / K ** 0.5).to("cuda", dtype)
    norm_w = torch.rand(K, generator=gen).to("cuda", dtype) + 0.5
    assert pa._skinny_config(N, K, False, M) is not None
    ref = pa.gemv_ref(x.float(), w.float(), norm_w.float(), 1e-5)
    compare(pa.skinny_matmul(x, w, norm_w, 1e-5), ref, dtype, f"skinny {dtype} {M}x{N}x{K}")


@DEVICE_DTYPES
@pytest.mark.parametrize("n_heads,n_kv,hd", [(4, 1, 32), (9, 3, 64)])
def test_rope_store_kvcache(device, dtype, n_heads, n_kv, hd):
    gen = torch.Generator().manual_seed(3)
    N_tok, num_blocks, block_size = 7, 4, 8
    q, k, v = fused_qkv_views(N_tok, n_heads, n_kv, hd, dtype, device, gen)
    positions = torch.randint(0, 100, (N_tok,), generator=gen).to(device)
    freqs = torch.outer(torch.arange(100.0), torch.rand(hd // 2, generator=gen))  # (100, hd/2)
    cos, sin = freqs.cos().to(device), freqs.sin().to(device)
    slot_mapping, k_cache, v_cache = random_pool(num_blocks, block_size, n_kv, hd, N_tok, 2,
                                                 dtype, device, gen)
    k_ref, v_ref, q_ref = k_cache.clone(), v_cache.clone(), q.clone()
    # the reference rotation against transformers' own, on the same tables
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
    full = lambda t: torch.cat((t, t), dim=-1)[positions.cpu()][None]  # noqa: E731
    q_model, k_model = (x[0].transpose(0, 1) for x in apply_rotary_pos_emb(
        q.cpu().float().transpose(0, 1)[None], k.cpu().float().transpose(0, 1)[None],
        full(cos.cpu()), full(sin.cpu())))                 # (N_tok, heads, hd) each, fp32
    pa.rope_store_kvcache_ref(q_ref, k, v, k_ref, v_ref, slot_mapping, positions, cos, sin)
    compare(q_ref.cpu(), q_model, dtype, "reference rotation of q against transformers")
    k_before = k_cache.clone()
    pa.rope_store_kvcache(q, k, v, k_cache, v_cache, slot_mapping, positions, cos, sin)
    compare(q, q_ref, dtype, "rotated q")
    compare(k_cache, k_ref, dtype, "rotated k in the pool")
    assert torch.equal(v_cache, v_ref)
    valid = slot_mapping >= 0
    compare(k_ref.view(-1, n_kv, hd)[slot_mapping[valid]].cpu(), k_model[valid.cpu()], dtype,
            "reference rotation of k against transformers")
    changed = (k_cache != k_before).flatten(2).any(-1).flatten()  # (num_blocks * block_size,)
    assert changed.nonzero().flatten().sort().values.tolist() == \
        slot_mapping[valid].sort().values.tolist(), "exactly the valid slots are written"


@DEVICE_DTYPES
def test_rope_store_kvcache_with_head_norms(device, dtype):
    """Qwen3's RMSNorm over each head of q and k, fused into the rotation, against the unfused
    steps: transformers' Qwen3RMSNorm on each head, then the rotation and store without norms."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm
    gen = torch.Generator().manual_seed(5)
    N_tok, n_heads, n_kv, hd, num_blocks, block_size = 6, 9, 3, 64, 4, 8
    q, k, v = fused_qkv_views(N_tok, n_heads, n_kv, hd, dtype, device, gen)
    positions = torch.randint(0, 100, (N_tok,), generator=gen).to(device)
    freqs = torch.outer(torch.arange(100.0), torch.rand(hd // 2, generator=gen))  # (100, hd/2)
    cos, sin = freqs.cos().to(device), freqs.sin().to(device)
    slot_mapping, k_cache, v_cache = random_pool(num_blocks, block_size, n_kv, hd, N_tok, 1,
                                                 dtype, device, gen)
    norms = [ns.RMSNorm(hd, 1e-6).to(device, dtype) for _ in range(2)]
    for n in norms:
        n.weight.data = (torch.rand(hd, generator=gen) + 0.5).to(device, dtype)
    hf_norms = [Qwen3RMSNorm(hd, eps=1e-6).to(device, dtype) for _ in range(2)]
    for h, n in zip(hf_norms, norms):
        h.weight.data = n.weight.data.clone()
    # unfused: each head normalized on its own, then the rotation and store without norms
    q_ref, k_ref, v_ref = hf_norms[0](q), k_cache.clone(), v_cache.clone()
    pa.rope_store_kvcache(q_ref, hf_norms[1](k), v, k_ref, v_ref, slot_mapping, positions, cos, sin)
    # the reference with norms, and the kernel with norms, each in one call
    q_torch, k_torch, v_torch = q.clone(), k_cache.clone(), v_cache.clone()
    pa.rope_store_kvcache_ref(q_torch, k, v, k_torch, v_torch, slot_mapping, positions, cos, sin,
                              *norms)
    pa.rope_store_kvcache(q, k, v, k_cache, v_cache, slot_mapping, positions, cos, sin, *norms)
    for what, (q_out, k_out, v_out) in (("reference", (q_torch, k_torch, v_torch)),
                                        ("kernel", (q, k_cache, v_cache))):
        compare(q_out, q_ref, dtype, f"{what}: normalized and rotated q")
        compare(k_out, k_ref, dtype, f"{what}: normalized and rotated k in the pool")
        assert torch.equal(v_out, v_ref)


@DEVICE_DTYPES
@pytest.mark.parametrize("N_tok,D", [(5, 96), (3, 2048)])
def test_rms_norm_and_silu_and_mul(device, dtype, N_tok, D):
    """The elementwise kernels against their references, and the references
    against the model's own CPU layers (checked against transformers)."""
    gen = torch.Generator().manual_seed(N_tok)
    x = torch.randn(N_tok, 2 * D, generator=gen).to(device, dtype)[:, :D]   # strided rows
    w = torch.randn(D, generator=gen).to(device, dtype)
    compare(pa.rms_norm(x, w, 1e-5), pa.rms_norm_ref(x.float(), w.float(), 1e-5), dtype,
            f"rms_norm {N_tok}x{D}")
    gate_up = torch.randn(N_tok, 2 * D, generator=gen).to(device, dtype)
    compare(pa.silu_and_mul(gate_up), pa.silu_and_mul_ref(gate_up.float()), dtype,
            f"silu_and_mul {N_tok}x{D}")
    x, w, gate_up = (t.cpu().float() for t in (x, w, gate_up))
    norm = ns.RMSNorm(D, 1e-5)
    norm.weight.data.copy_(w)
    assert torch.equal(pa.rms_norm_ref(x, w, 1e-5), norm(x))
    assert torch.equal(pa.silu_and_mul_ref(gate_up), F.silu(gate_up[:, :D]) * gate_up[:, D:])


# ----------------------------------------------------------------------------
# Following accepted drafts: the Triton kernel against its torch reference, and the reference
# against the rule spelled out.

@pytest.mark.parametrize("device", [
    pytest.param("cpu", marks=pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1")),
    pytest.param("cuda", marks=pytest.mark.skipif(NO_CUDA, reason="needs CUDA"))])
def test_follow_accepted_kernel(device):
    """Five sequences that drafted 1 to 15 tokens and kept none, some or all of them, each moved
    back in this step's buffers: its input, positions, slots and context length."""
    gen, bs = torch.Generator().manual_seed(5), 4
    cases = [(1, 0, 3), (4, 4, 1), (15, 7, 16), (3, 1, 5), (2, 2, 2)]   # (d, kept, width)
    tokens, plan, drafts, row = [], [], [], 0
    for m, (d, kept, width) in enumerate(cases):
        sampled = torch.randint(100, 200, (d + 1,), generator=gen).tolist()
        draft = sampled[:kept] + [t + 1 for t in sampled[kept:d]]    # the first miss at kept
        plan.append((len(tokens), d, row, width, 4 - m))
        drafts.append(draft + [-1] * (16 - d))
        tokens += sampled
        row += width
    table = torch.randperm(80, generator=gen).view(5, 16).to(torch.int32)   # (B, width)
    positions = torch.cat([torch.arange(w) + 20 + 3 * m for m, (_, _, w) in enumerate(cases)])
    lens = torch.tensor([40, 41, 42, 43, 44], dtype=torch.int32)
    buffers = [torch.zeros(row, dtype=torch.int64), positions, torch.full((row,), -1), lens]
    t = lambda x: torch.tensor(x, dtype=torch.int64)                    # noqa: E731
    ref = [x.clone() for x in buffers]
    pa.follow_accepted_ref(t(tokens), t(plan), t(drafts), *ref, table, bs)
    for m, ((d, kept, width), (r0, _, first, _, b)) in enumerate(zip(cases, plan)):
        assert ref[0][first] == tokens[r0 + kept] and ref[3][b] == lens[b] - (d - kept)
        pos = positions[first:first + width] - (d - kept)
        assert torch.equal(ref[1][first:first + width], pos)
        assert torch.equal(ref[2][first:first + width], table[b, pos // bs] * bs + pos % bs)
    out = [x.to(device) for x in buffers]
    pa._follow_accepted_kernel[(len(cases),)](
        t(tokens).to(device), t(plan).to(device), t(drafts).to(device), *out,
        table.to(device), table.stride(0), bs)
    for a, b in zip(out, ref):
        assert torch.equal(a.cpu(), b)


# ----------------------------------------------------------------------------
# Grammar masks: the in-place Triton mask against its torch reference, and the
# reference against the mask spelled out token by token.

@pytest.mark.parametrize("device", [
    pytest.param("cpu", marks=pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1")),
    pytest.param("cuda", marks=pytest.mark.skipif(NO_CUDA, reason="needs CUDA"))])
@pytest.mark.parametrize("B,V,rows", [(5, 1000, [3, 0]), (4, 49152, [0, 1, 2, 3]), (3, 97, [])])
def test_apply_token_mask_kernel(device, B, V, rows):
    """Random bits, a V that 32 does not divide (a last word's bits past V left set), rows out of
    order, unconstrained rows (exactly unchanged) and no constrained row at all."""
    gen = torch.Generator().manual_seed(V)
    logits = torch.randn(B, V, generator=gen)
    bitmask = torch.randint(-2 ** 31, 2 ** 31, (len(rows), -(-V // 32)), generator=gen,
                            dtype=torch.int64).to(torch.int32)
    bitmask[:, -1] |= -1 << (V % 32) if V % 32 else 0       # bits past V: allowed, never stored
    allowed = torch.ones(B, V, dtype=torch.bool)
    for r, row in enumerate(rows):
        allowed[row] = torch.tensor([bool(int(bitmask[r, t // 32]) >> (t % 32) & 1)
                                     for t in range(V)])
    expected = logits.masked_fill(~allowed, float("-inf"))
    ref = pa.apply_token_mask_ref(logits.clone(), torch.tensor(rows, dtype=torch.int64), bitmask)
    assert torch.equal(ref, expected)
    dev = logits.to(device)
    out = pa.apply_token_mask_triton(dev, torch.tensor(rows, dtype=torch.int64, device=device),
                                     bitmask.to(device))
    assert out is dev, "in place"
    print(f"{len(rows)} of {B} rows, V={V}: {int((~allowed).sum())} tokens masked")
    assert torch.equal(out.cpu(), expected)


# ----------------------------------------------------------------------------
# The CPU path (torch SDPA over K/V gathered from the pool) against the same
# references and NaN-poisoned pools; plain torch, so no interpreter needed.

CPU_DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])


@CPU_DTYPES
@SHAPES
@pytest.mark.parametrize("context_lens", [
    [1, 15, 16, 17, 67, 131],   # ragged: shorter contexts padded and masked
    [131],                      # one sequence: no mask at all
    [67, 67, 67],               # equal lengths: no mask either
], ids=["ragged", "one", "equal"])
def test_decode_sdpa(dtype, n_heads, n_kv, hd, block_size, context_lens):
    out, ref = run_decode(context_lens, n_heads, n_kv, hd, block_size, "cpu", dtype,
                          decode=pa.paged_attention_decode_sdpa)
    compare(out, ref, dtype, f"decode sdpa {n_heads}/{n_kv} hd{hd} bs{block_size} L={context_lens}")


@CPU_DTYPES
@SHAPES
def test_prefill_sdpa(dtype, n_heads, n_kv, hd, block_size):
    out, ref = run_prefill_mixed(n_heads, n_kv, hd, block_size, "cpu", dtype,
                                 prefill=pa.paged_attention_prefill_sdpa)
    compare(out, ref, dtype, f"prefill sdpa {n_heads}/{n_kv} hd{hd} bs{block_size}")


def test_sdpa_reads_consecutive_blocks_in_place():
    """A lone sequence whose blocks are consecutive in the pool is read as a view
    (no gather); the tail of its last block is NaN, so reading past L would show."""
    n_heads, n_kv, hd, bs, L = 8, 2, 64, 16, 61
    gen = torch.Generator().manual_seed(3)
    k_cache = torch.full((8, bs, n_kv, hd), float("nan"))
    v_cache = k_cache.clone()
    block_tables = torch.tensor([[2, 3, 4, 5, 0]], dtype=torch.int32)   # 4 blocks in order, 1 padding
    for cache in (k_cache, v_cache):
        cache.view(-1, n_kv, hd)[2 * bs:2 * bs + L] = torch.randn(L, n_kv, hd, generator=gen)
    lens = torch.tensor([L], dtype=torch.int32)
    k, _ = pa._read_kv(k_cache, v_cache, block_tables, lens, L, False, torch.float32)
    assert k.untyped_storage().data_ptr() == k_cache.untyped_storage().data_ptr(), "not read in place"
    q = torch.randn(1, n_heads, hd, generator=gen)
    out = pa.paged_attention_decode_sdpa(q, k_cache, v_cache, block_tables, lens, hd ** -0.5)
    ref = pa.paged_attention_decode_ref(q, k_cache, v_cache, block_tables, lens, hd ** -0.5)
    compare(out, ref, torch.float32, "decode sdpa in place")
    q = torch.randn(20, n_heads, hd, generator=gen)   # a chunk after a 41-token prefix
    cu = torch.tensor([0, 20], dtype=torch.int32)
    out = pa.paged_attention_prefill_sdpa(q, k_cache, v_cache, block_tables, cu, lens, hd ** -0.5)
    ref = pa.paged_attention_prefill_ref(q, k_cache, v_cache, block_tables, cu, lens, hd ** -0.5)
    compare(out, ref, torch.float32, "prefill sdpa in place")


def test_store_kvcache_sdpa():
    gen = torch.Generator().manual_seed(0)
    _, k, v = fused_qkv_views(9, 6, 3, 64, torch.float32, "cpu", gen)
    shape = (4, 8, 3, 64)
    k_cache, v_cache = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    slot_mapping = torch.randperm(32, generator=gen)[:9]
    pa.store_kvcache_ref(k, v, k_ref, v_ref, slot_mapping)
    pa.store_kvcache_sdpa(k, v, k_cache, v_cache, slot_mapping)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)
    slot_mapping[3] = -1   # a padding token has no place on the CPU path: an error, not a skip
    with pytest.raises((IndexError, RuntimeError)):
        pa.store_kvcache_sdpa(k, v, k_cache, v_cache, slot_mapping)


# ----------------------------------------------------------------------------
# CUDA graphs: the wrappers must never sync with the host

@pytest.mark.skipif(NO_CUDA, reason="needs CUDA")
def test_decode_cuda_graph():
    n_heads, n_kv, hd, bs = 8, 2, 128, 16
    gen = torch.Generator().manual_seed(2)
    context_lens = [40, 0, 200, 17]
    k_cache, v_cache, block_tables, lens = make_paged_cache(
        context_lens, bs, n_kv, hd, torch.bfloat16, "cuda", gen, extra_cols=8)
    q = torch.randn(len(context_lens), n_heads, hd, generator=gen).to("cuda", torch.bfloat16)
    out = torch.empty_like(q)
    pa.paged_attention_decode(q, k_cache, v_cache, block_tables, lens, hd ** -0.5, out=out)  # compile
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any host sync in the wrapper raises
    try:
        pa.paged_attention_decode(q, k_cache, v_cache, block_tables, lens, hd ** -0.5, out=out)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        pa.paged_attention_decode(q, k_cache, v_cache, block_tables, lens, hd ** -0.5, out=out)
    # new inputs in the same buffers, as the engine does between replays
    q.copy_(torch.randn(q.shape, generator=gen))
    lens.copy_(torch.tensor([39, 0, 150, 1]))
    graph.replay()
    ref = pa.paged_attention_decode_ref(q.float(), k_cache.float(), v_cache.float(), block_tables,
                                        lens, hd ** -0.5)
    compare(out, ref, torch.bfloat16, "decode replayed from a CUDA graph")


@pytest.mark.skipif(NO_CUDA, reason="needs CUDA")
def test_prefill_cuda_graph():
    """The varlen prefill kernel captured once for 96 rows and 6 sequences,
    then replayed on a batch of other lengths, fewer rows and sequences."""
    n_heads, n_kv, hd, bs = 8, 2, 64, 16
    gen = torch.Generator().manual_seed(5)
    k_cache, v_cache, block_tables, lens = make_paged_cache(
        [70, 40, 33, 17, 9, 1], bs, n_kv, hd, torch.bfloat16, "cuda", gen, extra_cols=4)
    q = torch.randn(96, n_heads, hd, generator=gen).to("cuda", torch.bfloat16)
    cu = torch.tensor([0, 30, 40, 73, 90, 95, 96], dtype=torch.int32, device="cuda")
    out = nan_like(q)
    args = (q, k_cache, v_cache, block_tables, cu, lens, hd ** -0.5)
    pa.paged_attention_prefill(*args, out=out)                    # compile
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        pa.paged_attention_prefill(*args, out=out)
    # 3 real sequences in 50 rows, then padding: rows past 50, sequences of no rows
    cu.copy_(torch.tensor([0, 40, 41, 50, 50, 50, 50]))
    lens.copy_(torch.tensor([70, 35, 33, 0, 0, 0]))
    q.copy_(torch.randn(q.shape, generator=gen))
    out.fill_(float("nan"))
    graph.replay()
    ref = pa.paged_attention_prefill_ref(q.float(), k_cache.float(), v_cache.float(), block_tables,
                                         cu, lens, hd ** -0.5)
    compare(out[:50], ref[:50], torch.bfloat16, "prefill replayed from a CUDA graph")
    assert out[50:].isnan().all(), "a padding row was written"


@pytest.mark.skipif(NO_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("attention", ["triton"])
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_graphs_equal_eager(tiny, attention, kv_cache_dtype):
    """Every step replayed from a CUDA graph (decode-only and prompt-carrying,
    padded to several sizes) gives the tokens of the same steps run eagerly:
    fp32, greedy, chunks of 24 tokens over prompts of 3 to 150, a pool small
    enough to preempt, and repeated prompts for prefix-cache hits; on a pool in
    the model's dtype and on an e4m3 one."""
    path, _ = tiny
    prompts = [list(range(5, 16)), [20, 21, 22], list(range(30, 180)), list(range(5, 16)) + [7],
               list(range(30, 180)), list(range(200, 290))]
    params = ns.SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    outs, graphs = {}, {}
    for eager in (True, False):
        llm = ns.LLM(path, device="cuda", dtype="float32", attention=attention, num_blocks=30,
                     block_size=8, max_num_batched_tokens=24, max_num_seqs=4, enforce_eager=eager,
                     kv_cache_dtype=kv_cache_dtype)
        outs[eager] = [o.token_ids for o in llm.generate(prompts, params)]
        graphs[eager] = llm.engine.runner.graph_sizes
        assert llm.stats()["preemptions_total"] > 0 and llm.stats()["prefix_cache_hit_tokens_total"] > 0
        check_pool_is_free(llm.engine)
    print("graph sizes:", graphs[False])
    assert graphs[True] == {True: [], False: []} and graphs[False][False] == [16, 24]
    assert outs[False] == outs[True]


# ---------------------------------------------------------------------------
# The HTTP server, end to end: a real uvicorn server on 127.0.0.1 in this
# process, the default model, and the official openai client (raw httpx for
# the malformed requests the client would refuse to send). Texts are greedy
# (one seeded test aside), so "the same request" has one right answer:
# streamed must equal non-streamed, and a request in a batch of 32 must equal
# itself run alone.

MODEL = os.path.basename(DEFAULT_MODEL)
KEY = "sk-test-key"
GREEDY_REQUEST = dict(model=MODEL, temperature=0, max_tokens=8)


def wait_healthy(url: str):
    deadline = time.time() + 30
    while True:
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.time() < deadline, "the server did not come up"
        time.sleep(0.05)


class ServerThread:
    """uvicorn on a free port of 127.0.0.1, in a thread of this process."""

    def __init__(self, app):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.url = "http://127.0.0.1:%d" % self.sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       daemon=True)
        self.thread.start()
        wait_healthy(self.url)

    def stop(self):
        self.server.should_exit = True
        self.thread.join(timeout=30)


# Prompts (token ids) on which the engine core process of the `engine`
# fixture fails on purpose: in add_request, in a step, or with a bug's error.
FAIL_ADD, FAIL_STEP, FAIL_BUG = [7001] * 3, [7002] * 3, [7003] * 3


def inject_faults(core):
    """Runs inside the engine core process (EngineCoreClient's `setup`)."""
    add, launch = core.add_request, core.runner.launch

    def add_request(request):
        if request.prompt_token_ids == FAIL_ADD:
            raise RuntimeError("injected failure")
        add(request)

    def launch_step(batch, prev=None):
        prompts = [s.token_ids[:s.num_prompt_tokens] for s in batch.seqs]
        if FAIL_STEP in prompts:
            raise RuntimeError("injected failure")
        if FAIL_BUG in prompts:
            return 1 / 0
        return launch(batch, prev)

    core.add_request, core.runner.launch = add_request, launch_step


def server_config(**kw):
    if OpenAI is None:
        pytest.skip("the server tests need the openai client")
    ensure_smol()
    # A shared CPU: one intra-op thread keeps OpenMP workers from spinning
    # against other processes (5-10x faster on a loaded 2-core machine).
    return Config(model=DEFAULT_MODEL, device="cpu", num_threads=1, **kw)


@pytest.fixture(scope="module")
def engine():
    """The engine core in its own process, as `nanoserve.py serve` runs it."""
    client = EngineCoreClient(server_config(), setup=inject_faults)
    yield client
    client.shutdown()


@pytest.fixture(scope="module")
def server(engine):
    srv = ServerThread(build_app(engine, engine.front.cfg))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def keyed_server():
    """A second server, with its own engine core, behind an API key."""
    cfg = server_config(api_key=KEY)
    client = EngineCoreClient(cfg)
    srv = ServerThread(build_app(client, cfg))
    yield srv
    srv.stop()
    client.shutdown()


@pytest.fixture(scope="module")
def client(server):
    return OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def metrics(server) -> dict:
    """/metrics as {series: value}, e.g. {'nanoserve_kv_blocks_used': 0.0}."""
    text = httpx.get(server.url + "/metrics", timeout=30).text
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines() if line and not line.startswith("#")}


def wait_idle(server, timeout=20) -> dict:
    """Poll /metrics until nothing runs and no KV block is held."""
    deadline = time.time() + timeout
    while True:
        m = metrics(server)
        if m["nanoserve_requests_running"] == 0 and m["nanoserve_requests_waiting"] == 0 \
                and m["nanoserve_kv_blocks_used"] == 0:
            return m
        assert time.time() < deadline, f"not idle after {timeout}s: {m}"
        time.sleep(0.1)


def stream_completion(client, **kw):
    """(text, finish_reason, usage, chunks) of a streamed completion."""
    chunks = list(client.completions.create(stream=True, **kw))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks
              if c.choices and c.choices[0].finish_reason]
    return text, finish, chunks[-1].usage, chunks


def stream_chat(client, **kw):
    chunks = list(client.chat.completions.create(stream=True, **kw))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return text, chunks


def assert_error(response, status, type="invalid_request_error"):
    assert response.status_code == status, (response.status_code, response.text)
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"], error
    assert error["type"] == type, error
    return error


# -- small endpoints --

def test_health_models_metrics(server, client):
    r = httpx.get(server.url + "/health")
    assert r.status_code == 200 and r.text == "ok"
    [model] = client.models.list().data
    assert model.id == MODEL and model.object == "model" and model.owned_by == "nanoserve"
    m = metrics(server)
    for name in ["nanoserve_requests_running", "nanoserve_requests_waiting",
                 "nanoserve_kv_blocks_used", "nanoserve_kv_blocks_total",
                 "nanoserve_generated_tokens_total", "nanoserve_preemptions_total",
                 "nanoserve_prefix_cache_hit_tokens_total", "nanoserve_prefix_cache_hit_rate",
                 'nanoserve_time_to_first_token_seconds_bucket{le="+Inf"}',
                 "nanoserve_time_to_first_token_seconds_sum",
                 "nanoserve_time_to_first_token_seconds_count",
                 'nanoserve_inter_token_latency_seconds_bucket{le="+Inf"}',
                 "nanoserve_inter_token_latency_seconds_count"]:
        assert name in m, name
    assert m["nanoserve_kv_blocks_total"] > 0


# -- completions and chat, streamed and not --

def test_completion(server, client, engine):
    prompt = "The capital of France is"
    before = metrics(server)
    r = client.completions.create(prompt=prompt, **GREEDY_REQUEST)
    num_prompt_tokens = len(engine.front.encode(prompt))    # reads only the tokenizer
    assert r.object == "text_completion" and r.model == MODEL
    assert r.choices[0].finish_reason == "length" and r.choices[0].text
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == \
        (num_prompt_tokens, 8, num_prompt_tokens + 8)
    text, finish, usage, chunks = stream_completion(
        client, prompt=prompt, stream_options={"include_usage": True}, **GREEDY_REQUEST)
    print(f"non-streamed {r.choices[0].text!r}, streamed {text!r}")
    assert text == r.choices[0].text and finish == ["length"]
    assert usage == r.usage and chunks[-1].choices == []
    assert all(c.object == "text_completion" and c.id == chunks[0].id for c in chunks)
    # the histograms saw these tokens: 2 first tokens, 2 * 7 gaps
    after = metrics(server)
    ttft, itl = ("nanoserve_time_to_first_token_seconds_count",
                 "nanoserve_inter_token_latency_seconds_count")
    assert after[ttft] - before[ttft] == 2 and after[itl] - before[itl] == 14
    tokens = "nanoserve_generated_tokens_total"
    assert after[tokens] - before[tokens] == 16


def test_chat(client):
    transformers = pytest.importorskip("transformers")
    messages = [{"role": "user", "content": "Write a poem about the sea."}]
    r = client.chat.completions.create(messages=messages, **GREEDY_REQUEST)
    c = r.choices[0]
    assert r.object == "chat.completion" and c.message.role == "assistant" and c.message.content
    # the prompt is the model's own template, rendered as transformers renders it
    reference = transformers.AutoTokenizer.from_pretrained(DEFAULT_MODEL).apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert r.usage.prompt_tokens == len(reference) and r.usage.completion_tokens == 8
    text, chunks = stream_chat(client, messages=messages, stream_options={"include_usage": True},
                               **GREEDY_REQUEST)
    print(f"non-streamed {c.message.content!r}, streamed {text!r}")
    assert text == c.message.content
    first, last = chunks[0].choices[0], chunks[-2].choices[0]    # then the usage chunk
    assert first.delta.role == "assistant" and first.delta.content == ""
    assert last.finish_reason == c.finish_reason == "length"
    assert last.delta.content is None and last.delta.role is None
    assert chunks[-1].choices == [] and chunks[-1].usage == r.usage
    assert all(ch.object == "chat.completion.chunk" for ch in chunks)


def test_stop_string(client):
    prompt = "Count: one, two, three, four,"
    full = client.completions.create(prompt=prompt, **{**GREEDY_REQUEST, "max_tokens": 12}).choices[0].text
    stop = full.split()[2]             # a word from the middle of the greedy text
    r = client.completions.create(prompt=prompt, stop=[stop], **{**GREEDY_REQUEST, "max_tokens": 12})
    text, finish, _, _ = stream_completion(client, prompt=prompt, stop=stop,
                                           **{**GREEDY_REQUEST, "max_tokens": 12})
    print(f"full {full!r}, stop {stop!r}, cut {r.choices[0].text!r}")
    assert r.choices[0].text == full[:full.index(stop)] == text
    assert stop not in text and r.choices[0].finish_reason == "stop" and finish == ["stop"]
    # completed by the token that reaches max_tokens: still cut, still "stop"
    kw = {**GREEDY_REQUEST, "prompt": "The capital of France is", "max_tokens": 5, "stop": "he"}
    r = client.completions.create(**kw).choices[0]
    text, finish, _, _ = stream_completion(client, **kw)
    print(f"stop 'he' at the last token: {r.text!r}, streamed {text!r}")
    assert r.text == text == " Paris.\n\nT" and r.finish_reason == "stop" and finish == ["stop"]


def test_stop_string_across_tokens(client, engine):
    """A stop string that starts inside one token and ends inside another is
    cut exactly, streamed and not (the front end finds it; the engine core
    is told to abort)."""
    prompt = "Count: one, two, three, four,"
    kw = {**GREEDY_REQUEST, "max_tokens": 12}
    r = client.completions.create(prompt=prompt, logprobs=0, **kw).choices[0]
    tokens = r.logprobs.tokens
    # from the last character of the 1st token to the first of the 3rd
    start = len(tokens[0]) - 1
    stop = r.text[start:start + len(tokens[1]) + 2]
    assert len(tokens[0]) >= 2 and len(tokens[2]) >= 2, tokens
    cut = r.text[:r.text.index(stop)]
    non_streamed = client.completions.create(prompt=prompt, stop=[stop], **kw).choices[0]
    streamed, finish, _, _ = stream_completion(client, prompt=prompt, stop=stop, **kw)
    print(f"tokens {tokens!r}, stop {stop!r}, cut {cut!r}")
    assert non_streamed.text == cut == streamed and finish == ["stop"]
    assert non_streamed.finish_reason == "stop"


def test_served_equals_offline(client, smol_llm):
    """The server's greedy texts equal LLM.generate's, request for request,
    with prompts sent at once as one batch request."""
    prompts = ["The capital of France is", "def fibonacci(n):", "My favourite colour is"]
    offline = smol_llm.generate(prompts, ns.SamplingParams(temperature=0, max_tokens=10))
    r = client.completions.create(prompt=prompts, **{**GREEDY_REQUEST, "max_tokens": 10})
    assert [c.text for c in sorted(r.choices, key=lambda c: c.index)] == [o.text for o in offline]


def test_served_drafts_keep_text_that_ends_mid_character(smol_llm):
    """Behind the server with drafts, a step's tokens may end inside a character, and several
    steps' tokens may reach the front end at once. For each stop string, the text, the tokens
    and finish_reason equal plain decoding's offline, streamed and not."""
    cfg = server_config(num_speculative_tokens=4)
    client = EngineCoreClient(cfg)
    srv = ServerThread(build_app(client, cfg))
    try:
        oai = OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        for stop in EMOJI_STOPS:
            ref = smol_llm.generate(EMOJI_PROMPT, ns.SamplingParams(
                temperature=0, max_tokens=24, stop=stop))[0]
            kw = dict(model=MODEL, prompt=EMOJI_PROMPT, temperature=0, max_tokens=24, stop=stop)
            r = oai.completions.create(**kw)
            text, finish, usage, _ = stream_completion(oai, stream_options={"include_usage": True},
                                                       **kw)
            print(stop, repr(ref.text), repr(r.choices[0].text), repr(text))
            assert r.choices[0].text == text == ref.text, stop
            assert r.choices[0].finish_reason == finish[0] == ref.finish_reason, stop
            assert r.usage.completion_tokens == usage.completion_tokens == len(ref.token_ids)
        assert client.stats["spec_decode_num_accepted_tokens_total"] > 0
    finally:
        srv.stop()
        client.shutdown()


def test_part_one_detokenizes_as_the_window():
    """Part one's text (each request's tokens decoded again, whole, at every step) equals the
    incremental detokenization chapter's window at every step, with tokens arriving 1 to 3 at a
    time: accents, CJK, an emoji split over byte tokens, runs of spaces, and random tokens."""
    ensure_smol()
    cfg = Config(device="cpu", num_threads=1)
    fronts = ns.FrontEnd(cfg, 1), ns.IncrementalFrontEnd(cfg, 1)
    text_ids = fronts[0].encode("Héllo wörld, 日本語 😀 ok\n  spaced   out ", add_special_tokens=False)
    gen = random.Random(0)
    for trial in range(20):
        tokens = text_ids + [gen.randrange(cfg.vocab_size) for _ in range(trial * 3)]
        states = [f.state_class("r", [1], ns.SamplingParams(), True) for f in fronts]
        i = 0
        while i < len(tokens):
            n = gen.randint(1, 3)
            for front, state in zip(fronts, states):
                state.token_ids += tokens[i:i + n]
                state.finish_reason = "length" if i + n >= len(tokens) else None
                front._detokenize([state])
            assert states[0].text == states[1].text, (trial, i)
            i += n
        assert states[0].text == fronts[0].decode(tokens)


def test_utf8_stream(client):
    """A character split over several tokens is sent whole, in one piece."""
    prompt = "Translate to Japanese and Chinese with emoji: I love cats 🐱 ->"
    text, _, _, chunks = stream_completion(client, prompt=prompt, logprobs=0,
                                           **{**GREEDY_REQUEST, "max_tokens": 16})
    pieces = [c.choices[0].text for c in chunks if c.choices]
    tokens = [t for c in chunks if c.choices and c.choices[0].logprobs
              for t in c.choices[0].logprobs.tokens]
    print(f"pieces {pieces!r}\ntokens {tokens!r}")
    assert any("\ufffd" in t for t in tokens), "no split character: the test proves nothing"
    assert all("\ufffd" not in p for p in pieces)
    r = client.completions.create(prompt=prompt, **{**GREEDY_REQUEST, "max_tokens": 16})
    assert text == r.choices[0].text


def test_n_seed_logprobs_echo(client):
    kw = dict(model=MODEL, prompt="Once upon a time", max_tokens=6, temperature=1.0, seed=7, n=2,
              logprobs=0)
    a, b = client.completions.create(**kw), client.completions.create(**kw)
    assert [c.text for c in a.choices] == [c.text for c in b.choices]   # seeded: reproducible
    assert a.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in a.choices)
    assert all(top == {} for c in a.choices for top in c.logprobs.top_logprobs)
    # echo with logprobs: the prompt's tokens come first, the first one with null
    r = client.completions.create(prompt="Hello, my name is", logprobs=2, echo=True, **GREEDY_REQUEST)
    c, lp, num_prompt = r.choices[0], r.choices[0].logprobs, r.usage.prompt_tokens
    assert c.text.startswith("Hello, my name is")
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.text_offset) == num_prompt + 8
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(len(top) <= 2 and logprob <= 0 for logprob, top in
               zip(lp.token_logprobs[1:], lp.top_logprobs[1:]))
    for logprob, top in zip(lp.token_logprobs[num_prompt:], lp.top_logprobs[num_prompt:]):
        assert abs(max(top.values()) - logprob) < 1e-4              # greedy: the top token
    assert lp.text_offset[num_prompt] == len("Hello, my name is")
    assert lp.text_offset == sorted(lp.text_offset)
    chat = client.chat.completions.create(messages=[{"role": "user", "content": "Hi"}],
                                          logprobs=True, top_logprobs=0, **GREEDY_REQUEST)
    content = chat.choices[0].logprobs.content
    assert len(content) == 8 and all(e.top_logprobs == [] and e.logprob <= 0 for e in content)


def test_every_choice_of_n_gets_its_logit_bias(server, client, engine):
    """n > 1 with logit_bias: each choice's parameters are checked (and its bias's keys made
    ints) on their own, so both choices are biased, and a stream in flight from another client
    goes on untouched. Before, only the first choice was checked: the step raised TypeError."""
    [token] = engine.front.encode(" sea", add_special_tokens=False)
    in_flight = client.completions.create(prompt="Once upon a time", stream=True,
                                          **{**GREEDY_REQUEST, "max_tokens": 24})
    first = next(in_flight)
    for route, kw in [("completions", dict(prompt="Hello")),
                      ("chat.completions", dict(messages=[{"role": "user", "content": "Hi"}]))]:
        create = client.completions.create if route == "completions" else \
            client.chat.completions.create
        r = create(model=MODEL, n=2, temperature=1.0, seed=3, max_tokens=3,
                   logit_bias={str(token): 100}, **kw)
        texts = [c.text if route == "completions" else c.message.content for c in r.choices]
        print(route, texts)
        assert texts == [" sea sea sea"] * 2
    rest = list(in_flight)
    assert first.choices[0].finish_reason is None and rest[-1].choices[0].finish_reason == "length"
    wait_idle(server)


# -- concurrency and aborts --

def test_concurrent_streams_equal_alone(server, client):
    """32 streams at once, each equal to the same request run alone."""
    prompts = [f"{name} lives in" for name in ["Alice", "Bob", "Carol", "Dave", "Erin", "Frank",
                                               "Grace", "Heidi"]]
    alone = {p: client.completions.create(prompt=p, **{**GREEDY_REQUEST, "max_tokens": 6}).choices[0].text
             for p in prompts}
    aclient = AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                          timeout=300)

    async def one(prompt):
        stream = await aclient.completions.create(prompt=prompt, stream=True,
                                                  **{**GREEDY_REQUEST, "max_tokens": 6})
        return "".join([c.choices[0].text async for c in stream])

    async def all_of_them():
        return await asyncio.gather(*[one(prompts[i % 8]) for i in range(32)])

    texts = asyncio.run(all_of_them())
    for i, text in enumerate(texts):
        assert text == alone[prompts[i % 8]], (i, text, alone[prompts[i % 8]])
    wait_idle(server)


def test_abort_mid_stream_frees_blocks(server, client):
    idle = wait_idle(server)
    stream = client.completions.create(prompt="Write a long story about a dragon.", stream=True,
                                       **{**GREEDY_REQUEST, "max_tokens": 2000},
                                       extra_body={"ignore_eos": True})
    for _, chunk in zip(range(2), stream):
        pass
    assert metrics(server)["nanoserve_kv_blocks_used"] > 0
    stream.close()
    after = wait_idle(server)          # running 0, blocks back, long before 2000 tokens
    tokens = "nanoserve_generated_tokens_total"
    assert after[tokens] - idle[tokens] < 100


def test_abort_non_streamed_on_disconnect(server):
    wait_idle(server)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", timeout=3,
                   json={"prompt": "Write a long story about a dragon.", "max_tokens": 2000,
                         "temperature": 0, "ignore_eos": True})
    wait_idle(server)


def test_a_body_sends_one_finish_when_its_state_finishes_during_the_disconnect_check():
    """A state that finishes while the body asks whether its client left is queued again: the
    body still folds one finish_reason ("lengthlength" before _until_gone asked after the take)."""
    state = ns.RequestState("r", [1], ns.SamplingParams(), incremental=True)
    state.token_ids, state.text = [7], "a"

    async def states():                    # what generate yields: the state, changed, finished
        yield state
        yield state

    class Request:                         # the step that finishes the state runs while it asks
        async def is_disconnected(self):
            if state.finish_reason is None:
                state.token_ids, state.text, state.finish_reason = [7, 8], "ab", "length"
            return False

    shape = ns._ChatShape(types.SimpleNamespace(model_name="m"), {}, 1)
    body = asyncio.run(shape.body(shape.chunks(ns._until_gone(states(), Request()), 1)))
    [choice] = body["choices"]
    assert (choice["message"]["content"], choice["finish_reason"]) == ("ab", "length"), choice
    assert body["usage"]["completion_tokens"] == 2


# -- errors --

BAD_COMPLETIONS = [
    ({"max_tokens": 4}, "prompt"),                               # prompt missing
    ({"prompt": {"a": 1}}, "prompt"),
    ({"prompt": [[1, 2], [3.5]]}, "prompt"),
    ({"prompt": ""}, None),                                      # empty
    ({"prompt": "hi", "max_tokens": "ten"}, "max_tokens"),
    ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "hi", "max_tokens": True}, "max_tokens"),
    ({"prompt": "hi", "temperature": "hot"}, "temperature"),
    ({"prompt": "hi", "temperature": -0.5}, "temperature"),
    ({"prompt": "hi", "top_p": 0}, "top_p"),
    ({"prompt": "hi", "top_p": 1.5}, "top_p"),
    ({"prompt": "hi", "stream": "yes"}, "stream"),
    ({"prompt": "hi", "n": 0}, "n"),
    ({"prompt": "hi", "n": 1.5}, "n"),
    ({"prompt": "hi", "stop": 5}, "stop"),
    ({"prompt": "hi", "stop": ["ok", 3]}, "stop"),
    ({"prompt": "hi", "logprobs": 50}, "logprobs"),
    ({"prompt": "hi", "max_tokens": 100_000}, None),             # over the context window
    ({"prompt": "hi", "num_speculative_tokens": 4}, "num_speculative_tokens"),  # the server's
]
BAD_CHATS = [
    {},
    {"messages": []},
    {"messages": "hi"},
    {"messages": [{"role": "user"}]},
    {"messages": [{"role": 1, "content": "hi"}]},
    {"messages": ["hi"]},
]


def test_bad_requests(server, engine):
    idle = wait_idle(server)
    url = server.url + "/v1/completions"
    for body, param in BAD_COMPLETIONS:
        error = assert_error(httpx.post(url, json=body), 400)
        assert error["param"] == param, (body, error)
    error = assert_error(httpx.post(url, json={"prompt": "hi", "max_tokens": 100_000}), 400)
    assert "100000" in error["message"] and str(engine.front.cfg.max_model_len) in error["message"]
    for body in BAD_CHATS:
        assert_error(httpx.post(server.url + "/v1/chat/completions", json=body), 400)
    for raw in [b"{not json", b"[1, 2]", b'"text"', b"\xff\xfe", b'{"prompt": "hi", "top_p": NaN}']:
        assert_error(httpx.post(url, content=raw), 400)
    error = assert_error(httpx.post(url, json={"prompt": "hi", "model": "gpt-4"}), 404)
    assert error["code"] == "model_not_found"
    assert_error(httpx.get(server.url + "/v1/nothing"), 404)
    assert wait_idle(server)["nanoserve_generated_tokens_total"] == \
        idle["nanoserve_generated_tokens_total"]      # nothing ran, nothing leaked


def test_api_key(keyed_server):
    url = keyed_server.url
    assert httpx.get(url + "/health").status_code == 200
    for headers in [{}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}]:
        assert_error(httpx.get(url + "/v1/models", headers=headers), 401)
        assert_error(httpx.post(url + "/v1/responses", json={"input": "hi"}, headers=headers), 401)
    with pytest.raises(APIStatusError) as e:
        OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).models.list()
    assert e.value.status_code == 401
    good = OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=120)
    assert good.models.list().data[0].id == MODEL
    r = good.completions.create(prompt="Hi", **{**GREEDY_REQUEST, "max_tokens": 2})
    assert r.usage.completion_tokens == 2


def test_engine_errors_fail_one_request(server, client, engine, monkeypatch):
    """An exception in add_request or in a step fails only the requests it
    touches (a 500 with an OpenAI body, or an error event in a stream); the
    engine core keeps serving. The faults are injected in the engine core
    process (inject_faults) for the FAIL_* prompts."""
    for prompt in [FAIL_ADD, FAIL_STEP]:
        r = httpx.post(server.url + "/v1/completions", timeout=60,
                       json={"prompt": prompt, "max_tokens": 3, "temperature": 0})
        assert "injected failure" in assert_error(r, 500, "internal_error")["message"]
        r = client.completions.create(prompt="Hello", **{**GREEDY_REQUEST, "max_tokens": 3})
        assert r.choices[0].finish_reason == "length"     # served as if nothing had happened
        wait_idle(server)
    monkeypatch.setattr(engine.front, "validate", lambda ids, params: {}["crash"])  # a handler bug
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "Hello"})
    assert "KeyError" in assert_error(r, 500, "internal_error")["message"]
    assert "Traceback" not in r.text
    monkeypatch.undo()
    with pytest.raises(Exception, match="ZeroDivisionError"):
        stream_completion(client, prompt=FAIL_BUG, **{**GREEDY_REQUEST, "max_tokens": 3})
    wait_idle(server)


def test_engine_core_death_fails_requests():
    """Killing the engine core process mid-stream ends the stream with an
    error event; /health then answers 503, and new requests fail at once."""
    cfg = server_config()
    client = EngineCoreClient(cfg)
    srv = ServerThread(build_app(client, cfg))
    try:
        oai = OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        stream = oai.completions.create(prompt="Write a long story about a dragon.", stream=True,
                                        **{**GREEDY_REQUEST, "max_tokens": 2000},
                                        extra_body={"ignore_eos": True})
        next(iter(stream))
        client.process.kill()
        with pytest.raises(APIError) as e:       # the error event, raised by the client
            for _ in stream:
                pass
        assert "engine core" in str(e.value)
        r = httpx.get(srv.url + "/health", timeout=10)
        assert r.status_code == 503, r.text
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "Hi"}, timeout=10)
        assert "engine core" in assert_error(r, 503, "internal_error")["message"]
    finally:
        srv.stop()
        client.shutdown()


# -- what real clients send (batch prompts, content parts, refused fields) --

def test_batch_prompts(client):
    """A list of prompts is one request with n choices per prompt, numbered
    prompt_index * n + choice as OpenAI numbers them; strings and token ids."""
    prompts = ["The capital of France is", "My favourite colour is"]
    kw = {**GREEDY_REQUEST, "max_tokens": 5, "extra_body": {"ignore_eos": True}}
    alone = [client.completions.create(prompt=p, **kw).choices[0].text for p in prompts]
    ids = [ns.load_tokenizer(DEFAULT_MODEL)[0].encode(p).ids for p in prompts]
    for batch in (prompts, ids):
        r = client.completions.create(prompt=batch, n=2, **kw)
        assert sorted(c.index for c in r.choices) == [0, 1, 2, 3]
        assert {c.index: c.text for c in r.choices} == {i: alone[i // 2] for i in range(4)}
        assert r.usage.completion_tokens == 20
        chunks = list(client.completions.create(prompt=batch, n=2, stream=True, **kw))
        texts = {}
        for c in chunks:
            for choice in c.choices:
                texts[choice.index] = texts.get(choice.index, "") + choice.text
        assert texts == {i: alone[i // 2] for i in range(4)}


def test_content_parts_tool_turns_and_models_retrieve(client):
    text = [{"role": "user", "content": "Name a fruit."}]
    parts = [{"role": "user", "content": [{"type": "text", "text": "Name a fruit."}]}]
    a = client.chat.completions.create(messages=text, **GREEDY_REQUEST).choices[0].message.content
    b = client.chat.completions.create(messages=parts, **GREEDY_REQUEST).choices[0].message.content
    assert a == b
    turns = [*text, {"role": "assistant", "content": None,
                     "tool_calls": [{"id": "1", "type": "function",
                                     "function": {"name": "f", "arguments": "{}"}}]},
             {"role": "tool", "tool_call_id": "1", "content": "apple"}]
    assert client.chat.completions.create(messages=turns, **GREEDY_REQUEST).choices[0].message.content
    with pytest.raises(APIStatusError) as e:
        client.chat.completions.create(messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}], **GREEDY_REQUEST)
    assert e.value.status_code == 400 and "image_url" in str(e.value)
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(APIStatusError) as e:
        client.models.retrieve("gpt-4")
    assert e.value.status_code == 404


REFUSED = [({"response_format": {"type": "yaml"}}, "response_format"),
           ({"tool_choice": "required"}, "tool_choice"),
           ({"best_of": 3}, "best_of"),
           ({"min_tokens": 4}, "min_tokens"),                   # not known: never ignored
           ({"guided_json": {}}, "guided_json")]


def test_refused_fields_name_themselves(server, client):
    for fields, param in REFUSED:
        r = httpx.post(server.url + "/v1/chat/completions", timeout=30, json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **fields})
        assert assert_error(r, 400)["param"] == param, (fields, r.text)
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "suffix": "!"})
    assert assert_error(r, 400)["param"] == "suffix"
    for fields in [{"user": "u1", "metadata": {"a": "b"}, "store": False},   # change nothing
                   {"response_format": {"type": "text"}, "tool_choice": "none"}]:
        r = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **fields})
        assert r.status_code == 200, r.text
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "best_of": 2, "n": 2,
                                                        "max_tokens": 2}, timeout=60)
    assert r.status_code == 200, r.text


# -- structured output: JSON mode, JSON schemas and forced tool calls --

PERSON = {   # every kind of constraint the tests check, strings and arrays bounded
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 18, "maximum": 99},
        "color": {"enum": ["red", "green", "blue"]},
        "address": {"type": "object", "additionalProperties": False, "required": ["city", "zip"],
                    "properties": {"city": {"type": "string", "maxLength": 20},
                                   "zip": {"type": "integer", "minimum": 10000, "maximum": 99999}}},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": 3}},
    "required": ["name", "age", "color", "address", "tags"],
    "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                     "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string", "maxLength": 10}},
    "required": ["zone"], "additionalProperties": False}}}


def check_person(text):
    """The text parses and conforms to PERSON: enum, bounds, required keys, no others."""
    v = json.loads(text)
    assert set(v) == set(PERSON["required"]), v
    assert isinstance(v["name"], str) and len(v["name"]) <= 20, v
    assert type(v["age"]) is int and 18 <= v["age"] <= 99, v
    assert v["color"] in ("red", "green", "blue"), v
    assert set(v["address"]) == {"city", "zip"} and type(v["address"]["zip"]) is int, v
    assert 10000 <= v["address"]["zip"] <= 99999 and len(v["address"]["city"]) <= 20, v
    assert len(v["tags"]) <= 3 and all(isinstance(t, str) and len(t) <= 10 for t in v["tags"]), v
    return v


def check_weather_call(call, name="get_weather", family="hermes"):
    """A call to name whose arguments fit its tool, and whose id is in the form the family's chat
    template takes back: Mistral's 9 letters or digits, OpenAI's call_... otherwise."""
    assert call.type == "function" and call.function.name == name
    assert re.fullmatch("[A-Za-z0-9]{9}", call.id) if family == "mistral" else \
        call.id.startswith("call_"), call.id
    args = json.loads(call.function.arguments)
    if name == "get_weather":
        assert set(args) == {"city", "unit"} and args["unit"] in ("celsius", "fahrenheit"), args
    else:
        assert set(args) == {"zone"} and len(args["zone"]) <= 10, args
    return args


PERSON_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON,
                                                        "strict": True}}
ASK_PERSON = [{"role": "user", "content": "Make up a person and describe them as JSON."}]


def test_json_schema_output(client):
    """Greedy and at temperature 1 with several seeds, every answer conforms to
    a strict schema and finishes with "stop"; streamed equals non-streamed."""
    kw = dict(model=MODEL, messages=ASK_PERSON, response_format=PERSON_FORMAT, max_tokens=200)
    greedy = client.chat.completions.create(temperature=0, **kw).choices[0]
    print("greedy:", greedy.message.content)
    check_person(greedy.message.content)
    assert greedy.finish_reason == "stop"
    text, chunks = stream_chat(client, temperature=0, **kw)
    assert text == greedy.message.content and chunks[-1].choices[0].finish_reason == "stop"
    sampled = client.chat.completions.create(temperature=1.0, seed=7, n=4, **kw).choices
    for c in sampled:
        print("sampled:", c.message.content)
        check_person(c.message.content)
        assert c.finish_reason == "stop"
    assert len({c.message.content for c in sampled}) > 1, "seeds 7 to 10 all gave the same text"
    obj = client.chat.completions.create(temperature=0, **{**kw, "response_format": {
        "type": "json_object"}}).choices[0].message.content
    assert isinstance(json.loads(obj), dict)
    anything = {"type": "json_schema", "json_schema": {"name": "any", "schema": {}}}
    r = client.chat.completions.create(temperature=0, **{**kw, "response_format": anything})
    if r.choices[0].finish_reason == "stop":         # the empty schema: any JSON value
        json.loads(r.choices[0].message.content)
    r = client.completions.create(model=MODEL, prompt="A person, as JSON:", max_tokens=200,
                                  temperature=0, extra_body={"response_format": PERSON_FORMAT})
    check_person(r.choices[0].text)


def test_openai_parse_returns_the_pydantic_object(client):
    pydantic = pytest.importorskip("pydantic")

    class Address(pydantic.BaseModel):
        city: str = pydantic.Field(max_length=20)
        zip: int = pydantic.Field(ge=10000, le=99999)

    class Person(pydantic.BaseModel):
        name: str = pydantic.Field(max_length=20)
        age: int = pydantic.Field(ge=18, le=99)
        address: Address

    r = client.chat.completions.parse(model=MODEL, messages=ASK_PERSON, response_format=Person,
                                      temperature=0, max_tokens=200)
    person = r.choices[0].message.parsed
    print("parsed:", person)
    assert isinstance(person, Person) and 18 <= person.age <= 99


def test_forced_tool_calls(client):
    """A named tool and "required" come back as tool_calls whose arguments fit
    the tool's parameters, with content null and finish_reason "tool_calls",
    streamed (as delta.tool_calls) and not."""
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    for choice, name in [({"type": "function", "function": {"name": "get_time"}}, "get_time"),
                         ("required", None)]:
        kw = dict(model=MODEL, messages=messages, tools=[WEATHER, TIME], tool_choice=choice,
                  temperature=0, max_tokens=100)
        r = client.chat.completions.create(**kw).choices[0]
        assert r.finish_reason == "tool_calls" and r.message.content is None
        [call] = r.message.tool_calls
        assert "index" not in call.model_dump()       # a stream's deltas have it; a body not
        args = check_weather_call(call, name or call.function.name)
        print(choice, "->", call.function.name, args)
        chunks = list(client.chat.completions.create(stream=True, **kw))
        deltas = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []]
        assert {tc.index for tc in deltas} == {0} and deltas[0].function.name == call.function.name
        assert json.loads("".join(tc.function.arguments for tc in deltas)) == args  # one call
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
        assert not "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    # earlier calls and their results go through the chat template
    turns = [*messages, r.message.model_dump(exclude_none=True),
             {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 degrees"}]
    r = client.chat.completions.create(model=MODEL, messages=turns, tools=[WEATHER],
                                       tool_choice="none", temperature=0, max_tokens=8)
    assert r.choices[0].message.content and r.choices[0].message.tool_calls is None


def test_forced_tool_call_streams_its_arguments(client):
    """A forced call streams as OpenAI's does: its name first, then its arguments in pieces as
    they are generated, then the finish_reason in a chunk of its own, on which the OpenAI SDK's
    stream helper fires tool_calls.function.arguments.done (it never did for a whole call)."""
    for choice in ({"type": "function", "function": {"name": "get_weather"}}, "required"):
        with client.chat.completions.stream(
                model=MODEL, messages=[{"role": "user", "content": "Weather in Paris?"}],
                tools=[WEATHER, TIME], tool_choice=choice, temperature=0, max_tokens=60) as s:
            events = list(s)
        pieces = [e.arguments_delta for e in events
                  if e.type == "tool_calls.function.arguments.delta"]
        [done] = [e for e in events if e.type == "tool_calls.function.arguments.done"]
        print(choice, "->", pieces)
        assert len(pieces) > 3 and "".join(pieces) == done.arguments
        check_weather_call(types.SimpleNamespace(type="function", id="call_", function=done),
                           done.name)
        last = [e.chunk.choices[0] for e in events if e.type == "chunk"][-1]
        assert last.finish_reason == "tool_calls" and last.delta.tool_calls is None


def test_stop_string_inside_a_forced_call(client):
    """A stop string that cuts a forced call leaves text, not a call: finish_reason "stop" and
    the text as content, streamed and not (a call that max_tokens cuts keeps "length"). One
    that never matches leaves the whole call, sent at the end."""
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Weather in Paris?"}],
              tools=[WEATHER], tool_choice={"type": "function", "function": {
                  "name": "get_weather"}}, temperature=0, max_tokens=60)
    r = client.chat.completions.create(stop=["Paris"], **kw).choices[0]
    assert r.finish_reason == "stop" and r.message.tool_calls is None
    assert r.message.content == '{"name": "get_weather", "arguments": {"city": "', r.message
    text, chunks = stream_chat(client, stop=["Paris"], **kw)
    assert text == r.message.content and chunks[-1].choices[0].finish_reason == "stop"
    assert not any(c.choices[0].delta.tool_calls for c in chunks)
    r = client.chat.completions.create(stop=["zzz"], **kw).choices[0]
    assert r.finish_reason == "tool_calls" and check_weather_call(r.message.tool_calls[0])


def test_held_forced_call_is_aborted_when_its_client_leaves(server):
    """A non-streamed forced call with `stop` is held to its end (hold), yet a client that
    leaves still has its request aborted within a step or so, not run to max_tokens. The call
    cannot end before: its grammar asks for 400 numbers."""
    numbers = {"type": "function", "function": {"name": "record", "parameters": {
        "type": "object", "required": ["numbers"], "properties": {"numbers": {
            "type": "array", "items": {"type": "integer"}, "minItems": 400}}}}}
    tokens = "nanoserve_generated_tokens_total"
    before = wait_idle(server)[tokens]
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/chat/completions", timeout=2, json={
            "messages": [{"role": "user", "content": "Record some numbers."}],
            "tools": [numbers], "tool_choice": {"type": "function", "function": {
                "name": "record"}}, "stop": ["zzz"], "temperature": 0, "max_tokens": 300})
    num_generated = wait_idle(server, timeout=60)[tokens] - before
    print(f"{num_generated} tokens generated")
    assert 0 < num_generated < 200


def test_tool_parameters_with_defs(client, engine):
    """Tools whose parameters are nested pydantic models ($defs and $ref, two tools with a
    model of the same name): the grammar resolves each tool's own $defs, and a forced call
    comes back valid against its model."""
    pydantic = pytest.importorskip("pydantic")

    class City(pydantic.BaseModel):
        name: str = pydantic.Field(max_length=20)
        country: str = pydantic.Field(max_length=20)

    class Trip(pydantic.BaseModel):
        origin: City
        destination: City

    class Other(pydantic.BaseModel):      # another "City", with other fields
        class City(pydantic.BaseModel):
            zone: int = pydantic.Field(ge=0, le=9)
        city: City

    tools = [{"type": "function", "function": {"name": n, "parameters": m.model_json_schema()}}
             for n, m in (("plan_trip", Trip), ("other", Other))]
    assert "$defs" in tools[0]["function"]["parameters"]
    grammar = engine.front.grammar(ns.tool_call_grammar("json", tools, "required", True), True)
    tokenizer = llguidance.LLTokenizer(os.path.join(SMOL_DIR, "tokenizer.json"))
    for text, ok in [('{"name": "other", "arguments": {"city": {"zone": 3}}}', True),
                     ('{"name": "other", "arguments": {"city": {"name": "Oslo"}}}', False)]:
        matcher = llguidance.LLMatcher(tokenizer, grammar)
        assert (matcher.consume_tokens(tokenizer.tokenize_str(text))
                and matcher.is_accepting()) == ok, text
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Plan a trip from Paris to Rome."}],
        tools=tools, tool_choice={"type": "function", "function": {"name": "plan_trip"}},
        temperature=0, max_tokens=80).choices[0]
    print(r.message.tool_calls)
    assert r.finish_reason == "tool_calls"
    Trip.model_validate_json(r.message.tool_calls[0].function.arguments)


def test_schema_without_additional_properties_gets_none(client, engine):
    """An object that lists properties and does not say additionalProperties gets none, as in
    vLLM's default backend; true still allows more. An integer without bounds ends within
    JSON's exact range. The README's example, served, ends in "stop" with its one key."""
    tokenizer = llguidance.LLTokenizer(os.path.join(SMOL_DIR, "tokenizer.json"))
    city = {"type": "object", "properties": {"city": {"type": "string"}}}
    number = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    for schema, text, ok in [(city, '{"city":"Oslo"}', True),
                             (city, '{"city":"Oslo","x":1}', False),
                             ({**city, "additionalProperties": True},
                              '{"city":"Oslo","x":1}', True),
                             (number, '{"n":-9007199254740991}', True),
                             (number, '{"n":%s}' % ("1" * 17), False)]:
        matcher = llguidance.LLMatcher(tokenizer, engine.front.grammar(json.dumps(schema)))
        assert (matcher.consume_tokens(tokenizer.tokenize_str(text))
                and matcher.is_accepting()) == ok, (schema, text)
    readme = {**city, "required": ["city"]}
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Name a city, as JSON."}],
        response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": readme}},
        temperature=0, max_tokens=30).choices[0]
    print(r.message.content)
    assert r.finish_reason == "stop" and set(json.loads(r.message.content)) == {"city"}


def test_strict_schema_that_breaks_a_rule_is_a_400(server):
    """strict: true follows OpenAI's rules, in response_format and in tools: a schema that
    breaks one gets a 400 that names the rule (PERSON, which keeps them, passes elsewhere)."""
    loose = {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}
    closed = {**loose, "additionalProperties": False}
    for schema, words in [(loose, "additionalProperties false"),
                          ({**closed, "required": []}, "required"),
                          ({**closed, "properties": {"a": loose}}, "(#/properties/a)")]:
        for fields, param in [
                ({"response_format": {"type": "json_schema", "json_schema": {
                    "name": "x", "schema": schema, "strict": True}}},
                 "response_format.json_schema.schema"),
                ({"tools": [{"type": "function", "function": {
                    "name": "f", "parameters": schema, "strict": True}}]},
                 "tools[0].function.parameters")]:
            r = httpx.post(server.url + "/v1/chat/completions", timeout=30, json={
                "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **fields})
            error = assert_error(r, 400)
            assert error["param"] == param and "strict" in error["message"], error
            assert words in error["message"], (words, error)
    r = httpx.post(server.url + "/v1/chat/completions", timeout=30, json={   # not strict: fine
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "response_format": {
            "type": "json_schema", "json_schema": {"name": "x", "schema": loose}}})
    assert r.status_code == 200, r.text
    unique = {**closed, "properties": {"a": {"type": "array", "uniqueItems": True}}}
    r = httpx.post(server.url + "/v1/chat/completions", timeout=30, json={   # a keyword it lacks
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "response_format": {
            "type": "json_schema", "json_schema": {"name": "x", "schema": unique, "strict": True}}})
    assert "uniqueItems" in assert_error(r, 400)["message"]


def test_schema_nested_too_deep_is_a_400(server, capfd):
    """A schema nested 250 deep, in response_format or in a tool's parameters, strict or not:
    a 400 that names the field and the depth, and no traceback in the log (prepare_schema
    recursed into a RecursionError, a 500)."""
    schema = {"type": "string"}
    for _ in range(250):
        schema = {"type": "object", "properties": {"a": schema}}
    capfd.readouterr()
    for strict in (False, True):
        for fields, param in [
                ({"response_format": {"type": "json_schema", "json_schema": {
                    "name": "x", "schema": schema, "strict": strict}}},
                 "response_format.json_schema.schema"),
                ({"tools": [{"type": "function", "function": {
                    "name": "f", "parameters": schema, "strict": strict}}],
                  "tool_choice": "required"}, "tools[0].function.parameters")]:
            r = httpx.post(server.url + "/v1/chat/completions", timeout=30, json={
                "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **fields})
            error = assert_error(r, 400)
            assert error["param"] == param and "nested more than 128" in error["message"], error
    err = capfd.readouterr().err
    assert "Traceback" not in err and "RecursionError" not in err, err[-2000:]


def test_schema_definitions_are_names_and_branches_stay_open(smol_llm):
    """draft-07's definitions is a map of names, as $defs is: a definition named like a
    keyword is a schema, closed like any other, and no rule of strict mode reads the map
    itself. A branch of allOf, anyOf or not gets no additionalProperties: closed, two allOf
    branches that ask for a key each could match nothing."""
    obj = {"type": "object", "properties": {"x": {"type": "string"}}, "required": ["x"]}
    closed = {**obj, "additionalProperties": False}
    schema = {"definitions": {"default": obj, "properties": obj}, "$ref": "#/definitions/default"}
    assert ns.prepare_schema(schema) == {**schema, "definitions": {"default": closed,
                                                                   "properties": closed}}
    strict = {"definitions": {"properties": closed}, "$ref": "#/definitions/properties"}
    assert ns.prepare_schema(strict, strict=True) == strict
    a, b = ({"type": "object", "properties": {k: obj}, "required": [k]} for k in "ab")
    schema = {"allOf": [a, b], "anyOf": [a, b], "not": {"properties": {"c": obj}}}
    inner = {k: {"type": "object", "properties": {k: closed}, "required": [k]} for k in "ab"}
    assert ns.prepare_schema(schema) == {"allOf": [inner["a"], inner["b"]],
                                         "anyOf": [inner["a"], inner["b"]],
                                         "not": {"properties": {"c": closed}}}
    tokenizer = llguidance.LLTokenizer(os.path.join(SMOL_DIR, "tokenizer.json"))
    grammar = smol_llm.front.grammar(json.dumps({"allOf": [a, b]}))
    matcher = llguidance.LLMatcher(tokenizer, grammar)
    text = '{"a":{"x":"1"},"b":{"x":"2"}}'
    assert matcher.consume_tokens(tokenizer.tokenize_str(text)) and matcher.is_accepting()


# -- the Responses API: a chat request in other words, its answer re-shaped --

R_WEATHER, R_TIME = ({"type": "function", **t["function"]} for t in (WEATHER, TIME))
ASK_WEATHER = "What is the weather in Paris?"


@pytest.fixture
def nudged(monkeypatch):
    """The small model, under tool_choice "auto", calls a tool when asked and answers once it
    has a tool's result: OPEN_A_CALL's bias on the opening of a call, for, then against. (Left
    alone, it imitates the calls it sees and never answers.) The server runs in this process."""
    plain = ns.DefaultServer.sampling_params

    async def sampling_params(server, f, max_tokens):
        if f.get("tool_choice") == "auto":
            sign = -1 if f["messages"][-1]["role"] == "tool" else 1
            f = {**f, "logit_bias": {t: sign * b for t, b in OPEN_A_CALL["hermes"].items()}}
        return await plain(server, f, max_tokens)
    monkeypatch.setattr(ns.DefaultServer, "sampling_params", sampling_params)


def test_responses_equal_their_chat_request(client):
    """A string, instructions, and a list of items (text parts, a developer message, an earlier
    call and its output) give the text and usage of the chat request they stand for, greedy. A
    response that max_output_tokens cuts is incomplete, where the chat's finish_reason is
    "length". The request's settings are echoed."""
    items = [{"role": "developer", "content": "Be brief."},
             {"type": "message", "role": "user", "content": [
                 {"type": "input_text", "text": "What time is it"},
                 {"type": "input_text", "text": "in Tokyo?"}]},
             {"type": "function_call", "call_id": "1", "name": "get_time",
              "arguments": '{"zone": "JST"}'},
             {"type": "function_call_output", "call_id": "1", "output": "9:00"}]
    as_chat = [{"role": "system", "content": "Be brief."},
               {"role": "user", "content": "What time is it\nin Tokyo?"}, *EARLIER_CALL[1:3]]
    statuses = set()
    for kw, messages in [
            (dict(input="What is the capital of France?"),
             [{"role": "user", "content": "What is the capital of France?"}]),
            (dict(input="Say hi.", instructions="Answer in French."),
             [{"role": "system", "content": "Answer in French."},
              {"role": "user", "content": "Say hi."}]),
            (dict(input=items, tools=[R_TIME], tool_choice="none"), as_chat)]:
        r = client.responses.create(model=MODEL, temperature=0, max_output_tokens=12, **kw)
        tools = dict(tools=[TIME], tool_choice="none") if "tools" in kw else {}
        c = client.chat.completions.create(model=MODEL, messages=messages, temperature=0,
                                           max_tokens=12, **tools)
        print(r.status, repr(r.output_text))
        assert r.id.startswith("resp_") and r.object == "response" and r.model == MODEL
        [message] = r.output
        assert message.type == "message" and message.role == "assistant"
        assert message.id.startswith("msg_") and message.status == r.status
        assert r.output_text == c.choices[0].message.content != ""
        assert (r.usage.input_tokens, r.usage.output_tokens, r.usage.total_tokens) == \
            (c.usage.prompt_tokens, c.usage.completion_tokens, c.usage.total_tokens)
        if c.choices[0].finish_reason == "stop":
            assert r.status == "completed" and r.incomplete_details is None
        else:
            assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
        assert (r.temperature, r.max_output_tokens, r.instructions, r.parallel_tool_calls) == \
            (0, 12, kw.get("instructions"), True)
        assert r.tool_choice == kw.get("tool_choice", "auto") and len(r.tools) == len(kw.get(
            "tools", []))
        statuses.add(r.status)
    assert statuses == {"completed", "incomplete"}


def outputs(response) -> list:
    """A response's items as (type, status, name, text or arguments), less their ids."""
    return [(item.type, item.status, getattr(item, "name", None), getattr(item, "arguments", None)
             or "".join(part.text for part in item.content)) for item in response.output]


def test_responses_stream(client):
    """stream=True sends the Responses events in OpenAI's order, numbered from 0: an item is
    added, grows by deltas and is done before the next. They end with the response that a
    request without stream gets, text or a call, incomplete or not. The SDK's stream helper
    grows the same text from the deltas, and its final response is the same."""
    text = ["response.created", "response.in_progress", "response.output_item.added",
            "response.content_part.added", "response.output_text.delta",
            "response.output_text.done", "response.content_part.done",
            "response.output_item.done"]
    call = [*text[:3], "response.function_call_arguments.delta",
            "response.function_call_arguments.done", "response.output_item.done"]
    for kw, order in [(dict(input="What is the capital of France?", max_output_tokens=20), text),
                      (dict(input="Name three fruits.", max_output_tokens=12), text),
                      (dict(input=ASK_WEATHER, tools=[R_WEATHER, R_TIME], tool_choice="required",
                            max_output_tokens=60), call)]:
        whole = client.responses.create(model=MODEL, temperature=0, **kw)
        events = list(client.responses.create(model=MODEL, temperature=0, stream=True, **kw))
        types = [t for t, _ in itertools.groupby(e.type for e in events)]  # a run of deltas: one
        print(whole.status, types)
        assert types == order + [f"response.{whole.status}"]
        assert [e.sequence_number for e in events] == list(range(len(events)))
        assert outputs(events[-1].response) == outputs(whole)
        assert events[-1].response.usage == whole.usage
        with client.responses.stream(model=MODEL, temperature=0, **kw) as s:
            helped = list(s)
        grown = [e.snapshot for e in helped if e.type.endswith(".delta")][-1]
        assert grown == (whole.output_text or whole.output[0].arguments)
        if whole.status == "completed":
            assert outputs(s.get_final_response()) == outputs(whole)


def test_responses_stream_ends_with_an_error_event():
    """An error after the first byte (the chat chunks raise, as when the engine core dies) ends
    the stream with an event numbered like the rest, in OpenAI's error shape, which the openai
    SDK raises."""
    async def chunks():
        yield {"index": 0, "delta": {"content": "Hi"}, "logprobs": None, "finish_reason": None}
        raise ns.APIError(500, "the engine core died", "internal_error")

    async def read(events):
        return [json.loads(event.removeprefix("data: ")) async for event in events]
    chat = types.SimpleNamespace(num_prompt_tokens=3, num_completion_tokens=1, chunks=None,
                                 server=types.SimpleNamespace(model_name=MODEL))
    written = asyncio.run(read(ns._ResponsesShape(chat, {}).stream(chunks(), False)))
    assert [e["type"] for e in written] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added", "response.output_text.delta", "error"]
    assert [e["sequence_number"] for e in written] == list(range(6))
    assert written[-1]["error"]["message"] == "the engine core died"


def test_responses_client_that_leaves_ends_its_request(server, client):
    """A client that leaves has its request aborted within a step or so, streamed or not, not
    run to max_output_tokens. Its text.format asks for 400 numbers, so it cannot end sooner."""
    numbers = {"type": "json_schema", "name": "numbers", "schema": {
        "type": "object", "required": ["numbers"], "properties": {"numbers": {
            "type": "array", "items": {"type": "integer"}, "minItems": 400}}}}
    kw = dict(model=MODEL, input="Count to 400.", text={"format": numbers}, temperature=0,
              max_output_tokens=2000)
    tokens = "nanoserve_generated_tokens_total"
    before = wait_idle(server)[tokens]
    stream = client.responses.create(stream=True, **kw)
    for _, event in zip(range(8), stream):           # created, in_progress, ..., some deltas
        pass
    stream.close()
    streamed = wait_idle(server, timeout=60)[tokens] - before
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/responses", json=kw, timeout=2)
    whole = wait_idle(server, timeout=60)[tokens] - before - streamed
    print(f"{streamed} tokens streamed, {whole} generated for a body, before each client left")
    assert 0 < streamed < 200 and 0 < whole < 200


def test_responses_function_calls(client, nudged):
    """A named tool, "required" and "auto" (the small model nudged) come back as function_call
    items whose arguments fit the tool's parameters. The call and its output, sent back as
    items, are answered in text."""
    for choice, name in [({"type": "function", "name": "get_time"}, "get_time"),
                         ("required", None), ("auto", None)]:
        r = client.responses.create(model=MODEL, input=ASK_WEATHER, tools=[R_WEATHER, R_TIME],
                                    tool_choice=choice, parallel_tool_calls=False,
                                    temperature=0, max_output_tokens=60)
        print(choice, "->", r.output)
        [call] = r.output
        assert call.type == "function_call" and call.status == "completed" == r.status
        assert call.id.startswith("fc_") and (name is None or call.name == name)
        check_weather_call(types.SimpleNamespace(type="function", id=call.call_id,
                                                 function=call), call.name)
    turns = [{"role": "user", "content": ASK_WEATHER}, call.model_dump(exclude_none=True),
             {"type": "function_call_output", "call_id": call.call_id,
              "output": "sunny, 21 degrees"}]
    r = client.responses.create(model=MODEL, input=turns, tools=[R_WEATHER, R_TIME],
                                temperature=0, max_output_tokens=8)
    print("answer:", r.output)
    assert [item.type for item in r.output] == ["message"] and r.output_text


def test_responses_text_format(client):
    """text.format constrains the output as chat's response_format does: the same greedy
    answer to a strict JSON schema, any JSON object, and client.responses.parse's object."""
    pydantic = pytest.importorskip("pydantic")
    fmt = {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}
    r = client.responses.create(model=MODEL, input=ASK_PERSON[0]["content"], temperature=0,
                                text={"format": fmt}, max_output_tokens=200)
    c = client.chat.completions.create(model=MODEL, messages=ASK_PERSON, temperature=0,
                                       response_format=PERSON_FORMAT, max_tokens=200)
    print(r.output_text)
    assert r.output_text == c.choices[0].message.content and r.status == "completed"
    check_person(r.output_text)
    assert r.text.format.name == "person"
    r = client.responses.create(model=MODEL, input=ASK_PERSON[0]["content"], temperature=0,
                                text={"format": {"type": "json_object"}}, max_output_tokens=100)
    assert r.status == "incomplete" or isinstance(json.loads(r.output_text), dict)

    class City(pydantic.BaseModel):
        name: str = pydantic.Field(max_length=20)
        population: int

    r = client.responses.parse(model=MODEL, input="Describe Paris.", text_format=City,
                               temperature=0, max_output_tokens=60)
    print(r.output_parsed)
    assert isinstance(r.output_parsed, City)


RESPONSES_REFUSED = [   # (fields, the param the 400 names)
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"top_logprobs": 2}, "top_logprobs"),                # not served: never ignored
    ({"include": ["message.output_text.logprobs"]}, "include"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input[0].content[0].image_url"),
    ({"input": [{"role": "user", "content": [{"type": "input_file"}]}]},
     "input[0].content[0].type"),
    ({"input": [{"type": "function_call_output", "output": "9:00"}]}, "input[0].call_id"),
    ({"input": [{"role": "tool", "content": "9:00"}]}, "input[0].role"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"tools": [{**R_TIME, "name": "get time"}]}, "tools[0].name"),
    ({"tools": [R_TIME], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ({"tool_choice": {"type": "file_search"}}, "tool_choice"),
    ({"text": {"format": {"type": "yaml"}}}, "text.format.type"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "strict": True, "schema": {
        "type": "object", "properties": {"a": {"type": "string"}}}}}}, "text.format.schema"),
    ({"input": []}, "input"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {   # chat's check, by
        "type": "object", "properties": {"a": {"type": "nope"}}}}}}, "response_format"),  # its name
]


def test_responses_refused_fields(server, client):
    """Fields that would change the output and are not served are refused with a 400 that names
    them by their path in the Responses body (a schema that only the chat handler's grammar
    check refuses is named as chat names it). previous_response_id's 400 says to send the whole
    conversation. Fields that change nothing are accepted. A wrong model name is a 404, as on
    every route, and an unknown path's 404 names /v1/responses among the served routes."""
    url = server.url + "/v1/responses"
    for fields, param in RESPONSES_REFUSED:
        r = httpx.post(url, timeout=30, json={"input": "hi", "max_output_tokens": 2, **fields})
        error = assert_error(r, 400)
        assert error["param"] == param, (fields, error)
    error = assert_error(httpx.post(url, json={"input": "hi", "max_output_tokens": 10**5}), 400)
    assert "100000" in error["message"], error
    with pytest.raises(APIStatusError) as e:
        client.responses.create(model=MODEL, input="hi", previous_response_id="resp_1")
    assert e.value.status_code == 400 and "whole conversation" in e.value.message
    r = client.responses.create(model=MODEL, input="hi", max_output_tokens=2, store=True,
                                metadata={"a": "b"}, user="u1", service_tier="auto",
                                reasoning={"effort": "low"}, include=[],
                                text={"format": {"type": "text"}, "verbosity": "low"})
    assert r.output_text and r.metadata == {"a": "b"}
    error = assert_error(httpx.post(url, json={"model": "gpt-5", "input": "hi"}), 404)
    assert error["code"] == "model_not_found" and MODEL in error["message"]
    error = assert_error(httpx.post(server.url + "/v1/nothing", json={}), 404)
    assert "/v1/chat/completions" in error["message"] and "/v1/responses" in error["message"]


def test_openai_agents_sdk_on_its_defaults(server, nudged):
    """The OpenAI Agents SDK with its default model class (the Responses API) and a function
    tool, pointed at the server and naming the served model: the agent calls the tool, sends
    back its output and answers, streamed and not. As in the README, a forced call with
    stop_on_first_tool ends on the tool's output, and an answer that max_tokens cuts raises
    ModelBehaviorError (response.incomplete). Its own default model is a 404."""
    agents = pytest.importorskip("agents", reason="the OpenAI Agents SDK (openai-agents) is "
                                                  "not installed")
    from agents.models.openai_provider import OpenAIProvider
    from pydantic import Field
    cities = []

    @agents.function_tool
    def get_weather(city: typing.Annotated[str, Field(max_length=20)]) -> str:   # as WEATHER's:
        # the nudge's "_" would fill an unbounded string
        """The weather in a city."""
        cities.append(city)
        return "sunny, 21 degrees"

    client = AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    config = agents.RunConfig(model_provider=OpenAIProvider(openai_client=client),
                              tracing_disabled=True)     # traces would go to OpenAI
    agent = agents.Agent(name="weather", instructions="You answer questions about the weather.",
                         model=MODEL, tools=[get_weather],
                         model_settings=agents.ModelSettings(temperature=0, max_tokens=100))

    async def run():
        result = await agents.Runner.run(agent, ASK_WEATHER, run_config=config)
        streamed = agents.Runner.run_streamed(agent, ASK_WEATHER, run_config=config)
        events = [e.data.type async for e in streamed.stream_events()
                  if e.type == "raw_response_event"]
        forced = await agents.Runner.run(agent.clone(
            model_settings=agents.ModelSettings(temperature=0, max_tokens=100,
                                                tool_choice="required"),
            tool_use_behavior="stop_on_first_tool"), ASK_WEATHER, run_config=config)
        cut = agents.ModelSettings(temperature=0, max_tokens=4)
        with pytest.raises(agents.ModelBehaviorError, match="response.incomplete"):
            await agents.Runner.run(agent.clone(model_settings=cut), ASK_WEATHER, run_config=config)
        with pytest.raises(APIStatusError) as e:
            await agents.Runner.run(agent.clone(model=None), ASK_WEATHER, run_config=config)
        return result, streamed, events, forced, e.value
    result, streamed, events, forced, error = asyncio.run(run())
    print(cities, repr(result.final_output), repr(streamed.final_output))
    assert cities and all(isinstance(c, str) and 0 < len(c) <= 20 for c in cities)
    for r in (result, streamed):                  # a call or more (parallel), then the answer
        kinds = [item.type for item in r.new_items]
        assert kinds.count("tool_call_item") == kinds.count("tool_call_output_item") >= 1
        assert kinds[-1] == "message_output_item", kinds
    assert result.final_output and streamed.final_output == result.final_output
    assert "response.function_call_arguments.delta" in events
    assert "response.output_text.delta" in events
    assert forced.final_output == "sunny, 21 degrees"
    assert [item.type for item in forced.new_items] == ["tool_call_item", "tool_call_output_item"]
    assert error.status_code == 404 and MODEL in error.message


# -- tool_choice "auto": each format's parser, and calls kept valid by the grammar --

W_CALL = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
T_CALL = '{"name": "get_time", "arguments": {"zone": "CET"}}'
PARSER_CASES = {   # format: [(the model's text, finish_reason, content, [(name, arguments)])]
    "hermes": [
        ("Sunny <in> Paris.", "stop", "Sunny <in> Paris.", []),
        (f"<tool_call>\n{W_CALL}\n</tool_call>", "stop", None,
         [("get_weather", '{"city": "Paris", "unit": "celsius"}')]),
        (f"<tool_call>\n{W_CALL}\n</tool_call>\n<tool_call>\n{T_CALL}\n</tool_call>", "stop", None,
         [("get_weather", '{"city": "Paris", "unit": "celsius"}'), ("get_time", '{"zone": "CET"}')]),
        (f"Let me look.\n<tool_call>\n{W_CALL}\n</tool_call>", "stop", "Let me look.",
         [("get_weather", '{"city": "Paris", "unit": "celsius"}')]),
        ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa', "length", None,
         [("get_weather", '{"city": "Pa')]),
        ("Cut at <tool_c", "length", "Cut at <tool_c", [])],
    "llama3": [
        ("Sunny in Paris.", "stop", "Sunny in Paris.", []),
        (W_CALL.replace("arguments", "parameters"), "stop", None,
         [("get_weather", '{"city": "Paris", "unit": "celsius"}')]),
        (f"{W_CALL}; {T_CALL}".replace("arguments", "parameters"), "stop", None,
         [("get_weather", '{"city": "Paris", "unit": "celsius"}'), ("get_time", '{"zone": "CET"}')]),
        ("Text first {} is text", "stop", "Text first {} is text", []),   # a call is the whole answer
        ('{"name": "get_time", "parameters": {"zo', "length", None, [("get_time", '{"zo')])],
    "mistral": [
        ("Sunny [in] Paris.", "stop", "Sunny [in] Paris.", []),
        (f"[TOOL_CALLS] [{W_CALL}]", "stop", None,
         [("get_weather", '{"city": "Paris", "unit": "celsius"}')]),
        (f"[TOOL_CALLS] [{W_CALL}, {T_CALL}]", "stop", None,
         [("get_weather", '{"city": "Paris", "unit": "celsius"}'), ("get_time", '{"zone": "CET"}')]),
        (f"Let me look.[TOOL_CALLS] [{W_CALL}]", "stop", "Let me look.",
         [("get_weather", '{"city": "Paris", "unit": "celsius"}')]),
        ('[TOOL_CALLS] [{"name": "get_time", "arguments": {"zo', "length", None,
         [("get_time", '{"zo')]),
        ("Cut at [TOOL_C", "length", "Cut at [TOOL_C", [])],
}


def parse_stream(fmt, pieces, finish):
    """A chat answer in fmt, its text sent in pieces: (the chunks, the chunks folded into one)."""
    shape = ns._ToolCallShape(None, {}, 0, ns.TOOL_CALL_FORMATS[fmt])   # no fields: no log-probs
    delta = lambda text, finish=None: ns.Delta(0, text, [1] if text else [], finish)
    chunks = shape.opening(0) + [shape.choice(delta(p)) for p in pieces]
    chunks.append(shape.last(types.SimpleNamespace(text="".join(pieces)), delta("", finish)))
    whole = {}
    for c in chunks:
        shape.fold(whole, json.loads(json.dumps(c)))   # a copy: fold keeps what it is given
    return chunks, whole


@pytest.mark.parametrize("fmt", PARSER_CASES)
def test_tool_call_parsers(fmt, smol_llm):
    """Each format's parser: content, calls and finish_reason as OpenAI has them, the same
    whether the text comes whole or in pieces of 1, 3 or 7 characters (markup split anywhere),
    no markup in any content delta; and the format's grammar accepts every complete answer."""
    tools = [WEATHER, TIME]
    lark = ns.tool_call_grammar(fmt, tools, "auto", True)
    grammar = smol_llm.front.grammar(lark, True)
    tokenizer = llguidance.LLTokenizer(os.path.join(SMOL_DIR, "tokenizer.json"))
    for text, finish, content, calls in PARSER_CASES[fmt]:
        _, whole = parse_stream(fmt, [text], finish)
        message = whole["delta"]
        got = [(c["function"]["name"], c["function"]["arguments"])
               for c in message.get("tool_calls", [])]
        assert (message["content"], got) == (content, calls), (text, message)
        assert whole["finish_reason"] == ("tool_calls" if calls and finish == "stop" else finish)
        assert all(c["id"].startswith("call_") and c["type"] == "function"
                   for c in message.get("tool_calls", []))
        for size in (1, 3, 7):
            chunks, streamed = parse_stream(fmt, [text[i:i + size] for i in
                                                  range(0, len(text), size)], finish)
            for c in streamed["delta"].get("tool_calls", []):
                c["id"] = None
            for c in message.get("tool_calls", []):
                c["id"] = None
            assert streamed == whole, (size, text)
            sent = [c["delta"].get("content") or "" for c in chunks]
            markup = ("<tool_call>", "</tool_call>", "[TOOL_CALLS]")
            assert not any(m in s for s in sent for m in markup), sent
            firsts = [tc for c in chunks for tc in c["delta"].get("tool_calls", []) if "id" in tc]
            assert [tc["function"]["name"] for tc in firsts] == [name for name, _ in calls]
        if finish == "stop":                       # what the grammar lets the model write
            matcher = llguidance.LLMatcher(tokenizer, grammar)
            assert matcher.consume_tokens(tokenizer.tokenize_str(text)), (text, matcher.get_error())
            assert matcher.is_accepting(), text


HERMES_TEMPLATE = (   # a Qwen2.5-like template: it renders the tools and earlier calls itself
    "{% if tools %}<|im_start|>system\nTools:\n<tools>{% for t in tools %}\n{{ t | tojson }}"
    "{% endfor %}\n</tools>\nCall one as <tool_call>\n{\"name\": ..., \"arguments\": ...}\n"
    "</tool_call><|im_end|>\n{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% for c in m.tool_calls or [] %}<tool_call>\n{{ {'name': c.function.name, "
    "'arguments': c.function.arguments} | tojson }}\n</tool_call>{% endfor %}"
    "{{ m.content }}<|im_end|>\n{% endfor %}<|im_start|>assistant\n")
LLAMA_TEMPLATE = (   # a Llama-3.1-like template: tools in the user turn, calls as bare JSON
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if tools and loop.last %}Answer with "
    "{\"name\": function name, \"parameters\": dictionary of arguments}, or in text. Functions:"
    "{% for t in tools %}\n{{ t | tojson }}{% endfor %}\n{% endif %}{% for c in m.tool_calls or [] "
    "%}{{ {'name': c.function.name, 'parameters': c.function.arguments} | tojson }}{% endfor %}"
    "{{ m.content }}<|im_end|>\n{% endfor %}<|im_start|>assistant\n")
MISTRAL_TEMPLATE = (   # a Mistral-v0.3-like template: tools before the last [INST], calls as a list
    "{% set check = 'Tool call IDs should be alphanumeric strings with length 9!' %}"   # as v0.3
    "{% for m in messages %}{% if m.role == 'user' %}{% if tools and loop.last %}[AVAILABLE_TOOLS] ["
    "{% for t in tools %}{{ t | tojson }}{% if not loop.last %}, {% endif %}{% endfor %}]"
    "[/AVAILABLE_TOOLS]{% endif %}[INST] {{ m.content }}[/INST]{% elif m.tool_calls %}"
    "[TOOL_CALLS] [{% for c in m.tool_calls %}{% if not (c.id is string and c.id | length == 9 "
    "and c.id.isalnum()) %}{{ raise_exception(check) }}{% endif %}{{ {'name': c.function.name, "
    "'arguments': c.function.arguments} | tojson }}{% if not loop.last %}, {% endif %}{% endfor %}]"
    "</s>{% elif m.role == 'tool' %}{% if not (m.tool_call_id | length == 9 and "
    "m.tool_call_id.isalnum()) %}{{ raise_exception(check) }}{% endif %}"
    "[TOOL_RESULTS] {{ m.content }}[/TOOL_RESULTS]"
    "{% else %}{{ m.content }}</s>{% endif %}{% endfor %}")
# logit_bias on the tokens of "<tool_call>" (or "{" for Llama's calls) makes the small model open
# a call; from there the grammar writes it (the bias stays: "_" is each string's likeliest letter)
OPEN_A_CALL = {"hermes": {"44": 100, "19324": 100, "79": 100, "4350": 100, "46": 100},
               "llama3": {"107": 100, "39428": 100, "79": 100},
               "mistral": {str(t): 100 for t in (75, 10179, 7113, 79, 51, 3206, 12041, 77, 933)}}


EARLIER_CALL = [{"role": "user", "content": "What time is it in Tokyo?"},
                {"role": "assistant", "content": None, "tool_calls": [{
                    "id": "a1b2c3d4e", "type": "function",
                    "function": {"name": "get_time", "arguments": '{"zone": "JST"}'}}]},
                {"role": "tool", "tool_call_id": "a1b2c3d4e", "content": "9:00"},
                {"role": "assistant", "content": "It is 9:00."}]


def test_tool_call_format_detection(tmp_path):
    """The format is read from the chat template; the flag overrides it."""
    for name in ("config.json", "tokenizer.json"):
        (tmp_path / name).symlink_to(os.path.join(SMOL_DIR, name))
    smol = json.loads(open(os.path.join(SMOL_DIR, "tokenizer_config.json")).read())
    for template, flag, fmt in [(HERMES_TEMPLATE, "auto", "hermes"),
                                (LLAMA_TEMPLATE, "auto", "llama3"),
                                (MISTRAL_TEMPLATE, "auto", "mistral"),
                                (smol["chat_template"], "auto", "hermes"),   # renders no tools
                                (HERMES_TEMPLATE, "llama3", "llama3")]:
        (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
        cfg = Config(model=str(tmp_path), device="cpu", tool_call_parser=flag)
        assert ns.GrammarFrontEnd(cfg, 1).tool_call_format == fmt, (template[:40], flag)


def test_auto_tool_calls(engine, client):
    """tool_choice "auto" on the small model: with templates that render tools (given here, in
    three formats) and with the model's own, which renders none; a call comes back valid, streamed
    equal to non-streamed, and the round trip (call, result, answer) renders with the arguments
    as an object and is answered. Without the bias the model answers in text."""
    front, own = engine.front, engine.front.chat_template
    for source, fmt in [(HERMES_TEMPLATE, "hermes"), (None, "hermes"), (LLAMA_TEMPLATE, "llama3"),
                        (MISTRAL_TEMPLATE, "mistral")]:
        # Mistral's opening takes the small model 9 tokens: an earlier call shows it their order
        messages = (EARLIER_CALL if fmt == "mistral" else []) + [
            {"role": "user", "content": "What is the weather in Paris?"}]
        kw = dict(model=MODEL, messages=messages, tools=[WEATHER, TIME], temperature=0,
                  max_tokens=60, parallel_tool_calls=False)
        template = ns.ChatTemplate({"chat_template": source}) if source else own
        front.chat_template, front.tool_call_format = template, fmt
        try:
            r = client.chat.completions.create(logit_bias=OPEN_A_CALL[fmt], **kw).choices[0]
            chunks = list(client.chat.completions.create(stream=True, logit_bias=OPEN_A_CALL[fmt],
                                                         **kw))
            text = client.chat.completions.create(**{**kw, "max_tokens": 8}).choices[0]
            turns = [*messages, r.message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": r.message.tool_calls[0].id,
                      "content": "sunny, 21 degrees"}]
            prompt = ns.GrammarServer.chat_text(SimpleNamespace(front=front), {   # the server's
                "messages": ns._messages(turns, {}), "tools": [WEATHER, TIME]})
            answer = client.chat.completions.create(**{**kw, "messages": turns, "max_tokens": 8})
        finally:
            front.chat_template, front.tool_call_format = own, "hermes"
        print("auto:", r.message.tool_calls, "| text:", text.message)
        assert r.finish_reason == "tool_calls" and r.message.content is None
        calls = [(c.function.name, check_weather_call(c, c.function.name, fmt))
                 for c in r.message.tool_calls]
        streamed = {}
        for c in chunks:
            for tc in (c.choices[0].delta.tool_calls or []) if c.choices else []:
                streamed.setdefault(tc.index, [tc.function.name, ""])[1] += tc.function.arguments
        assert [(n, json.loads(a)) for n, a in streamed.values()] == calls
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
        assert text.message.tool_calls is None and text.message.content
        call, key = r.message.tool_calls[0], ns.TOOL_CALL_FORMATS[fmt][2]
        assert f'"{key}": {json.dumps(json.loads(call.function.arguments))}' in prompt, prompt
        assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_forced_call_goes_back_through_mistrals_template(engine, client):
    """A forced call's id (json format, Mistral's family) is 9 letters or digits, which Mistral's
    template requires of every id: the call sent back with its result is answered (200)."""
    front, own = engine.front, engine.front.chat_template
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    kw = dict(model=MODEL, tools=[WEATHER], temperature=0, max_tokens=40,
              tool_choice={"type": "function", "function": {"name": "get_weather"}})
    front.chat_template = ns.ChatTemplate({"chat_template": MISTRAL_TEMPLATE})
    front.tool_call_format = "mistral"
    try:
        r = client.chat.completions.create(messages=messages, **kw).choices[0]
        chunks = list(client.chat.completions.create(messages=messages, stream=True, **kw))
        turns = [*messages, r.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": r.message.tool_calls[0].id, "content": "sunny"}]
        answer = client.chat.completions.create(**{**kw, "messages": turns, "tool_choice": "none",
                                                   "max_tokens": 4})
    finally:
        front.chat_template, front.tool_call_format = own, "hermes"
    check_weather_call(r.message.tool_calls[0], family="mistral")
    [streamed_id] = [tc.id for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []
                     if tc.id]
    assert re.fullmatch("[A-Za-z0-9]{9}", streamed_id), streamed_id
    assert answer.choices[0].finish_reason in ("stop", "length")

def special_call_token_model(tmp_path) -> str:
    """A random Mistral (bench.py's mistral-tiny, with bench.py's Mistral chat template) whose
    tokenizer is the default model's with <file_sep> (id 5, as in Mistral v0.3) renamed
    [TOOL_CALLS] and still special, as Mistral's is."""
    import bench
    tok = tmp_path / "tokenizer"
    tok.mkdir()
    text = open(os.path.join(ensure_smol(), "tokenizer.json")).read()
    (tok / "tokenizer.json").write_text(text.replace('"<file_sep>"', '"[TOOL_CALLS]"'))
    (tok / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<|im_start|>", "eos_token": "<|im_end|>"}))
    (tok / "config.json").symlink_to(os.path.join(SMOL_DIR, "config.json"))
    return str(bench.build_random_model("mistral-tiny", tmp_path, "cpu", tokenizer=str(tok)))


def test_mistral_special_call_token_opens_a_call(tmp_path):
    """Where the tokenizer makes [TOOL_CALLS] a special token (Mistral v0.3's), tool_choice "auto"
    still gets calls: the grammar lets the model write that token, and the front end shows its
    text, which the parser reads. logit_bias makes the random model open a call."""
    path = special_call_token_model(tmp_path)
    cfg = Config(model=path, device="cpu", num_threads=1)
    engine = EngineCoreClient(cfg)
    srv = ServerThread(build_app(engine, cfg))
    try:
        client = OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        assert engine.front.tool_call_format == "mistral"
        kw = dict(model=os.path.basename(path), temperature=0, max_tokens=40, tools=[TIME],
                  messages=[{"role": "user", "content": "What time is it in Paris?"}],
                  parallel_tool_calls=False, logit_bias={"5": 100})
        r = client.chat.completions.create(**kw).choices[0]
        chunks = list(client.chat.completions.create(stream=True, **kw))
        plain = client.completions.create(model=kw["model"], prompt="hi", max_tokens=3,
                                          logit_bias={"5": 100}, temperature=0)
    finally:
        srv.stop()
        engine.shutdown()
    print(r.message, "|", plain.choices[0].text)
    assert r.finish_reason == "tool_calls" and r.message.content is None
    check_weather_call(r.message.tool_calls[0], "get_time", "mistral")
    streamed = [tc.function.name for c in chunks if c.choices
                for tc in c.choices[0].delta.tool_calls or [] if tc.function.name]
    assert streamed == ["get_time"] and chunks[-1].choices[0].finish_reason == "tool_calls"
    assert plain.choices[0].text.startswith("[TOOL_CALLS]")     # shown outside of tools too


def test_random_model_of_every_family_chats(tmp_path):
    """`bench.py model --random NAME --tokenizer weights/SmolLM2-135M-Instruct` builds a small
    random model of each family the README lists. It carries the default model's tokenizer and
    a chat template in its family's format, so it answers a chat with no download."""
    import bench
    ensure_smol()
    messages = [{"role": "user", "content": "Name a fruit."}]
    for name, family, turn in [("tiny", "llama", "<|start_header_id|>assistant<|end_header_id|>\n\n"),
                               ("qwen3-tiny", "qwen3", "<|im_start|>assistant\n"),
                               ("qwen2.5-tiny", "qwen2", "<|im_start|>assistant\n"),
                               ("mistral-tiny", "mistral", "[INST] Name a fruit.[/INST]")]:
        path = bench.build_random_model(name, tmp_path, "cpu", tokenizer=SMOL_DIR)
        assert json.loads((path / "config.json").read_text())["model_type"] == family
        llm = ns.LLM(str(path), device="cpu", num_blocks=16)
        prompt = llm.front.chat_template.render(messages)
        assert prompt.endswith(turn), prompt
        [out] = llm.generate(llm.front.encode(prompt, add_special_tokens=False),
                             ns.SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        print(name, repr(out.text))
        assert len(out.token_ids) == 4 and out.text


@pytest.mark.parametrize("name,fmt,tools_shown", [
    ("tiny", "llama3", "<|start_header_id|>user<|end_header_id|>\n\nAnswer with a JSON object"),
    ("qwen3-tiny", "hermes", "<tools>\n"), ("qwen2.5-tiny", "hermes", "<tools>\n"),
    ("mistral-tiny", "mistral", "[AVAILABLE_TOOLS] [")], ids=["llama", "qwen3", "qwen2.5", "mistral"])
def test_random_model_of_every_family_calls_its_own_way(tmp_path, name, fmt, tools_shown):
    """bench.py's random model of each family, with the default model's tokenizer: its chat
    template shows the tools the family's way, and nanoserve reads the family's own tool-call
    format from it (--tool-call-parser auto). A call forced by tool_choice comes back parsed,
    with an id in the family's form, and goes back through the template with its result."""
    import bench
    ensure_smol()
    path = bench.build_random_model(name, tmp_path, "cpu", tokenizer=SMOL_DIR)
    cfg = Config(model=str(path), device="cpu", num_threads=1)
    engine = EngineCoreClient(cfg)
    srv = ServerThread(build_app(engine, cfg))
    messages = [{"role": "user", "content": "What time is it in Paris?"}]
    kw = dict(model=path.name, tools=[TIME], temperature=0, max_tokens=60,
              tool_choice={"type": "function", "function": {"name": "get_time"}})
    try:
        client = OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        assert engine.front.tool_call_format == fmt
        assert tools_shown in engine.front.chat_template.render(messages, [TIME])
        r = client.chat.completions.create(messages=messages, **kw).choices[0]
        turns = [*messages, r.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": r.message.tool_calls[0].id, "content": "9:00"}]
        answer = client.chat.completions.create(**{**kw, "messages": turns, "tool_choice": "none",
                                                   "max_tokens": 4})
    finally:
        srv.stop()
        engine.shutdown()
    print(name, r.message.tool_calls)
    assert r.finish_reason == "tool_calls" and r.message.content is None
    check_weather_call(r.message.tool_calls[0], "get_time", fmt)
    assert answer.choices[0].finish_reason in ("stop", "length")

BAD_STRUCTURED = [   # (chat fields, the param the 400 names)
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "nope"}}}}}},
     "response_format"),                                           # the library cannot compile it
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": "json_object"}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": []}}},
     "response_format.json_schema.schema"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}],
      "tool_choice": "required"}, "tools[0].function.name"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "{}"}}],
      "tool_choice": "required"}, "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]},   # auto
     "tools[0].function.name"),
    *[({"tools": [WEATHER, {"type": "function", "function": {"name": name}}]},
       "tools[1].function.name") for name in ("", "x</tool_call>", "f" * 300)],   # OpenAI's rule
    ({"messages": [{"role": "tool", "content": "21 degrees"}]}, "messages"),   # no tool_call_id
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [{"function": "f"}]}]},
     "messages"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": 3}}},
     "tool_choice.function.name"),
    ({"stream": True, "stream_options": {"include_usage": "yes"}}, "stream_options.include_usage"),
    ({"stream_options": {"unknown": True}}, "stream_options.unknown"),
    ({"tools": [None]}, "tools[0]"),                 # a null item is not an absent field
]


def test_tool_names_follow_openai():
    """A tool's name is 1-64 of a-z, A-Z, 0-9, _ and -, as OpenAI checks it: anything else (an
    empty name, the call's own markup, 300 letters, a newline after a good name) is a 400."""
    spec = {"tools": ns.CHAT_FIELDS["tools"]}
    for name in ("a", "get_weather-2", "Z" * 64):
        tools = [{"type": "function", "function": {"name": name}}]
        assert ns.parse_fields({"tools": tools}, spec)["tools"] == tools
    for name in ("", "x</tool_call>", "f" * 300, "f" * 65, "get weather", "f\n", "é"):
        with pytest.raises(ns.APIError) as e:
            ns.parse_fields({"tools": [{"type": "function", "function": {"name": name}}]}, spec)
        assert e.value.status == 400, name
        assert e.value.body["error"]["param"] == "tools[0].function.name", name


def test_structured_output_bad_input_is_a_400(server):
    idle = wait_idle(server)
    for fields, param in BAD_STRUCTURED:
        r = httpx.post(server.url + "/v1/chat/completions", timeout=30, json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **fields})
        error = assert_error(r, 400)
        assert error["param"] == param, (fields, error)
    r = httpx.post(server.url + "/v1/completions", timeout=30,
                   json={"prompt": "hi", "response_format": {"type": "xml"}})
    assert assert_error(r, 400)["param"] == "response_format"
    assert wait_idle(server)["nanoserve_generated_tokens_total"] == \
        idle["nanoserve_generated_tokens_total"]


def test_tokenizer_larger_than_the_vocab_is_a_400(server, engine, monkeypatch):
    """llguidance builds no matcher when the tokenizer has more tokens than the model's
    vocab_size ("vocab size too small"): the server says so at validation, with a 400, rather
    than failing the request in the engine core."""
    monkeypatch.setattr(engine.front.cfg, "vocab_size", engine.front.cfg.vocab_size - 1)
    r = httpx.post(server.url + "/v1/chat/completions", timeout=30, json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
        "response_format": {"type": "json_schema", "json_schema": {"name": "vocab", "schema": {
            "type": "object", "properties": {"vocab_check": {"type": "integer"}}}}}})
    assert "vocab_size" in assert_error(r, 400)["message"]


def test_grammar_masks_match_one_matcher_at_a_time():
    """GrammarMasks fills on its thread pool exactly the bitmasks each matcher computes alone,
    into rows of its reused buffer, and its parallel consume moves each matcher as consume_token
    does (a rejected token: the error state). Matchers at different points of one JSON schema;
    then the matchers it builds for requests, each a fresh one."""
    import numpy as np
    V = ns.Config(ensure_smol(), device="cpu").vocab_size     # the engine's vocabulary
    tokenizer = llguidance.LLTokenizer(os.path.join(SMOL_DIR, "tokenizer.json"), n_vocab=V)
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(PERSON))
    texts = ['', '{"name": "Al', '{"name": "Al", "age": 4', '{"name": "Al", "age": 40, "color": "']
    def matchers():
        out = [llguidance.LLMatcher(tokenizer, grammar) for _ in texts]
        for m, text in zip(out, texts):
            assert m.consume_tokens(tokenizer.tokenize_str(text)) if text else True
        return out
    masks = ns.GrammarMasks(os.path.join(SMOL_DIR, "tokenizer.json"), [2], len(texts) + 2, V,
                            pin=False)
    for _ in range(2):                                  # the buffer reused: no stale bits
        rows, bitmask = masks.fill_async(matchers(), [3, 0, 2, 1], "cpu").result()
        assert rows.tolist() == [3, 0, 2, 1] and bitmask.shape == (len(texts), -(-V // 32))
        for m, got in zip(matchers(), bitmask):
            alone = np.frombuffer(m.compute_bitmask(), np.int32)[:len(got)]   # (+1 word there)
            assert np.array_equal(got.numpy(), alone) and alone.any()
    ids = [tokenizer.tokenize_str(t)[0] for t in ['{"', 'bert', '"', 'xyz']]
    together, alone = matchers(), matchers()
    masks.consume(list(zip(together, ids)))
    for a, b, t in zip(together, alone, ids):
        assert b.consume_token(t) == (not a.is_error()), t
        assert a.compute_bitmask() == b.compute_bitmask()
    assert [m.is_error() for m in together] == [False, False, True, True]
    # each request's own matcher, from the families in turn: fresh, and none shares a state
    own = [masks.new_matcher(grammar) for _ in range(masks.num_threads + 1)]
    assert own[0].consume_tokens(tokenizer.tokenize_str(texts[2]))
    for m in own[1:]:
        assert m.compute_bitmask() == llguidance.LLMatcher(tokenizer, grammar).compute_bitmask()


def test_constrained_rows_in_the_engine(smol_llm):
    """Offline: unconstrained requests batched with constrained ones are token
    for token what they are alone; a constrained request preempted and
    recomputed comes out as it does without preemption. An "auto" tool row (free
    text, strict from its trigger on) is one more constrained row."""
    grammar = smol_llm.front.grammar(json.dumps(PERSON))
    prompt = smol_llm.front.chat_template.render(ASK_PERSON)
    constrained = [ns.SamplingParams(temperature=t, seed=3, max_tokens=200, grammar=grammar)
                   for t in (0, 1.0)]
    tools = [WEATHER, TIME]
    auto = ns.SamplingParams(temperature=0, max_tokens=60, logit_bias=OPEN_A_CALL["hermes"],
                             grammar=smol_llm.front.grammar(ns.tool_call_grammar(
                                 "hermes", tools, "auto", False), True))
    ask_weather = [{"role": "user", "content": "What is the weather in Paris?"}]
    alone = smol_llm.generate(SMOL_PROMPTS[:2], GREEDY)
    mixed = smol_llm.generate([prompt, SMOL_PROMPTS[0], prompt, SMOL_PROMPTS[1],
                               ns.GrammarServer.chat_text(types.SimpleNamespace(   # the server's
                                   front=smol_llm.front), {"messages": ask_weather, "tools": tools})],
                              [constrained[0], GREEDY, constrained[1], GREEDY, auto])
    assert [mixed[1].token_ids, mixed[3].token_ids] == [o.token_ids for o in alone]
    content, [(name, arguments)] = ns.split_tool_calls(ns.TOOL_CALL_FORMATS["hermes"],
                                                       mixed[4].text, True)
    print("auto row:", repr(mixed[4].text))
    assert content == "" and mixed[4].finish_reason == "stop"
    check_weather_call(types.SimpleNamespace(type="function", id="call_", function=types.
        SimpleNamespace(name=name, arguments=arguments)), name)
    for o in (mixed[0], mixed[2]):
        check_person(o.text)
        assert o.finish_reason == "stop"
    print("constrained output lengths:", len(mixed[0].token_ids), len(mixed[2].token_ids))
    # each needs 9-10 blocks of 8 at the end: 14 cannot hold both
    small = ns.LLM(SMOL_DIR, device="cpu", num_blocks=14, block_size=8, enable_prefix_caching=False)
    preempted = small.generate([prompt, prompt], [dataclasses.replace(p, max_tokens=60)
                                                  for p in constrained])
    assert small.stats()["preemptions_total"] > 0
    assert [o.token_ids for o in preempted] == [mixed[0].token_ids, mixed[2].token_ids]
    check_pool_is_free(small.engine)
    check_pool_is_free(smol_llm.engine)


BAD_INPUTS = [  # raw bodies: none of them may reach a 500
    (b'{"prompt": "\\ud800 hi"}', 400),
    (b'{"messages": [{"role": "user", "content": "\\udfff"}]}', 400),
    (b'{"prompt": "hi", "temperature": 1' + b"0" * 400 + b"}", 400),   # 10**400
    (b'{"prompt": "hi", "temperature": 1e400}', 400),
    (b'{"prompt": "hi", "seed": 1' + b"0" * 30 + b"}", 400),           # past 64 bits
    (b'{"prompt": "hi", "top_k": 1' + b"0" * 30 + b"}", 400),
    (b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}", 400),          # deep nesting
    (b'{"prompt": "hi", "max_tokens": 0}', 400),
    (b'{"prompt": "hi", "max_tokens": 2, "seed": 18446744073709551615, "n": 2}', 200),
]


def test_bad_inputs_are_4xx_and_the_server_stays_up(server, capfd):
    url = server.url + "/v1/completions"
    for body, status in BAD_INPUTS:
        path = "/v1/chat/completions" if b"messages" in body else "/v1/completions"
        r = httpx.post(server.url + path, content=body, timeout=60)
        if status == 200:
            assert r.status_code == 200, (body[:60], r.text)
        else:
            assert_error(r, status)
            assert "Traceback" not in r.text
    # lower-case scheme names are fine (an unkeyed server ignores the header)
    assert httpx.post(url, json={"prompt": "hi", "max_tokens": 1},
                      headers={"Authorization": "bearer x"}, timeout=30).status_code == 200
    # a huge body is refused, and /health answers quickly meanwhile
    megabyte = b"a" * 2**20

    def huge():                       # 64 MB, sent in chunks: no Content-Length to go by
        yield b'{"prompt": "'
        for _ in range(64):
            yield megabyte
            time.sleep(0.01)
        yield b'"}'
    result = {}
    thread = threading.Thread(target=lambda: result.update(
        r=httpx.post(url, content=huge(), timeout=60)))
    health = []
    with httpx.Client(base_url=server.url, timeout=5) as probe:
        probe.get("/health")          # connected before the timing starts
        thread.start()
        while thread.is_alive():
            start = time.perf_counter()
            assert probe.get("/health").status_code == 200
            health.append(time.perf_counter() - start)
            time.sleep(0.01)
    thread.join()
    print(f"/health answered in at most {max(health) * 1e3:.1f} ms over {len(health)} probes")
    assert_error(result["r"], 413)
    # A server that read the body on its event loop would answer no probe until the 413:
    # several answers during the upload, most of them quick, show it kept serving. (The
    # slowest single probe is left unbounded: on a 2-core machine it measures the load.)
    assert len(health) >= 3
    assert sorted(health)[len(health) // 2] < 0.1
    wait_idle(server)
    assert "Traceback" not in capfd.readouterr().err


def start_serve(*flags):
    """`nanoserve.py serve` as a user starts it, in a process of its own on a free port of
    127.0.0.1: (process, url, pids of its children, the engine core among them), once
    /health answers."""
    server_config()                                  # skips without the default model
    import subprocess
    with socket.socket() as s:                       # a free port, freed again for serve
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "nanoserve.py", "serve", "--port", str(port), *flags],
                            cwd=os.path.dirname(os.path.abspath(__file__)),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        for line in iter(proc.stdout.readline, ""):   # loaded, the KV pool, then serving
            if "serving" in line:
                break
        else:
            raise AssertionError("serve exited before it was serving")
        with open(f"/proc/{proc.pid}/task/{proc.pid}/children") as f:
            children = [int(pid) for pid in f.read().split()]
        wait_healthy(f"http://127.0.0.1:{port}")
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    return proc, f"http://127.0.0.1:{port}", children


def wait_exited(pids: list, timeout: float):
    def alive(pid):                                  # a zombie has exited too
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().split()[2] != "Z"
        except FileNotFoundError:
            return False
    deadline = time.time() + timeout
    while any(alive(pid) for pid in pids):
        assert time.time() < deadline, "the engine core outlived its server"
        time.sleep(0.2)


def in_session(sid: int) -> list:
    """The live processes of session sid: all that a child started with start_new_session
    started in turn, wherever they were reparented."""
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                state, _, _, session = f.read().rsplit(")", 1)[1].split()[:4]
        except (FileNotFoundError, ProcessLookupError):
            continue
        if int(session) == sid and state != "Z":
            pids.append(int(pid))
    return pids


def test_engine_core_exits_with_the_server():
    """`serve` killed outright (no shutdown code runs): its engine core
    process sees the pipe close and exits, so nothing keeps the device."""
    proc, url, children = start_serve()
    try:
        assert children, "no engine core process"
    finally:
        proc.kill()
        proc.wait()
    wait_exited(children, 60)


def test_sigterm_drains_the_stream_in_flight():
    """SIGTERM, as a rolling restart behind a load balancer sends it: a stream in flight
    ends whole, with all its tokens and [DONE]; a new connection meanwhile is refused (or
    answered 503), so the balancer sends it elsewhere; then the server and its engine core
    exit. Not vacuous: the signal is sent after the first token, and tokens must still
    arrive after the server has been seen refusing."""
    proc, url, children = start_serve("--num-threads", "1")
    num_tokens = 24
    body = dict(model=MODEL, prompt="The capital of France is", max_tokens=num_tokens,
                temperature=0, ignore_eos=True, stream=True,
                stream_options={"include_usage": True})
    events, first_token = [], threading.Event()   # (arrival time, SSE data) per event

    def read():
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line:
                    events.append((time.monotonic(), line.removeprefix("data: ")))
                    first_token.set()
        first_token.set()                         # a stream that ended early fails below
    reader = threading.Thread(target=read)
    try:
        assert children, "no engine core process"
        reader.start()
        assert first_token.wait(60)
        proc.send_signal(signal.SIGTERM)
        sigterm_at = time.monotonic()
        refused_by = None                         # how the server turned a new connection away
        while refused_by is None:
            assert time.monotonic() < sigterm_at + 30, "still accepting 30 s after SIGTERM"
            try:
                if httpx.get(url + "/health", timeout=5).status_code == 503:
                    refused_by = "503"
            except httpx.ConnectError:
                refused_by = "refused"
            except httpx.TransportError:          # accepted just before the socket closed
                pass
            time.sleep(0.01)
        refused_at = time.monotonic()
        assert proc.poll() is None, "the server exited instead of draining"
        reader.join(60)
        # exits by itself; uvicorn raises the signal again once drained (older ones return 0)
        assert proc.wait(60) in (0, -signal.SIGTERM)
    finally:
        proc.kill()
        proc.wait()
    output = proc.stdout.read()
    assert "Traceback" not in output, output
    assert events and events[-1][1] == "[DONE]", events[-3:]
    chunks = [json.loads(data) for _, data in events[:-1]]
    assert chunks[-1]["usage"]["completion_tokens"] == num_tokens, chunks[-1]
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"
    times = [t for t, _ in events[:-1]]
    late = [t for t, c in zip(times, chunks) if t > refused_at and c["choices"]
            and c["choices"][0]["text"]]
    print(f"SIGTERM after the first token; new connections {refused_by} "
          f"{(refused_at - sigterm_at) * 1e3:.0f} ms later; {len(late)} chunks with text after "
          f"that; the stream finished {times[-1] - sigterm_at:.2f} s after SIGTERM")
    assert late, "the stream had ended before the server refused: nothing was drained"
    wait_exited(children, 30)


# ---------------------------------------------------------------------------
# Tensor parallelism on the CPU: gloo between processes, the default model cut
# over 3 ranks (9 query heads, 3 KV heads: 3 and 1 per rank). Each run is in
# processes of its own, so this one never joins a process group; each has a
# time limit, so a rank that hangs fails the test.

TP = 3
TP_PROMPTS = ["The capital of France is", "My favourite colour is", "def fibonacci(n):"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_processes(target, args_of_rank, timeout=240):
    """target(*args) in a spawned process per entry; all must exit 0 within timeout."""
    ctx = torch.multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=target, args=args) for args in args_of_rank]
    for p in procs:
        p.start()
    deadline = time.time() + timeout
    for p in procs:
        p.join(max(1, deadline - time.time()))
    hung = [p for p in procs if p.is_alive()]
    for p in hung:
        p.kill()
        p.join()
    assert not hung, f"a process hung for {timeout} s"
    assert [p.exitcode for p in procs] == [0] * len(procs), [p.exitcode for p in procs]


def _sharded_layer_rank(rank, port):
    """One rank: layer 0's attention and MLP unsharded (before the group exists, so
    nothing is summed), then sharded over TP ranks with their all-reduces;
    every rank holds the whole output."""
    torch.set_num_threads(1)
    T = 40
    x = torch.randn(T, 576, generator=torch.Generator().manual_seed(1))
    outputs = {}
    for tp in (1, TP):
        if tp > 1:
            ns._init_group("cpu", rank, tp, port)
        cfg = Config(model=DEFAULT_MODEL, device="cpu", num_blocks=64, tensor_parallel_size=tp)
        model = ns.build_shard(cfg)        # the rank's shard (all of it at 1)
        attn = model.layers[0].attn
        shape = (64, 16, cfg.num_kv_heads // tp, cfg.head_dim)  # (num_blocks, block_size, n_kv, hd)
        attn.k_cache, attn.v_cache = torch.zeros(shape), torch.zeros(shape)
        with torch.no_grad():
            outputs[tp] = (attn(x, torch.arange(T), model.rope, prefill_meta(T)),
                           model.layers[0].mlp(x, residual=x))
    assert_close(f"attention, rank {rank} of {TP}", outputs[TP][0], outputs[1][0], 1e-5)
    assert_close(f"MLP + residual, rank {rank} of {TP}", outputs[TP][1], outputs[1][1], 1e-5)


def test_tensor_parallel_layers_equal_unsharded():
    """Attention (q/k/v column-parallel, o row-parallel + all-reduce) and the MLP
    (gate/up column-parallel, down row-parallel + all-reduce, the residual on
    rank 0 only) over 3 gloo ranks equal the whole layers to 1e-5."""
    ensure_smol()
    port = free_port()
    run_processes(_sharded_layer_rank, [(rank, port) for rank in range(TP)])


def _tp_generate(queue):
    """In-process LLM at TP ranks: greedy outputs, then a worker killed mid-run, then
    generate after close."""
    llm = ns.LLM(DEFAULT_MODEL, device="cpu", num_blocks=256, num_threads=1,
                 tensor_parallel_size=TP)
    greedy = ns.SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    queue.put([o.token_ids for o in llm.generate(TP_PROMPTS, greedy)])
    worker = llm.engine.runner.workers.procs[0]
    threading.Timer(1.0, os.kill, (worker.pid, signal.SIGKILL)).start()
    try:
        llm.generate(TP_PROMPTS[0], ns.SamplingParams(max_tokens=4000, ignore_eos=True))
        queue.put("no error")
    except Exception as e:
        queue.put(f"{type(e).__name__}: {e}")
    llm.close()
    try:
        llm.generate(TP_PROMPTS[0], greedy)
        queue.put("no error")
    except Exception as e:
        queue.put(f"{type(e).__name__}: {e}")


def test_tensor_parallel_llm_equals_tp1_and_a_dead_worker_raises(smol_llm):
    """LLM(tensor_parallel_size=3) in fp32 decodes greedily token for token as
    TP=1 does; then, a worker killed mid-run, generate raises (no hang) and every
    process exits. Once closed, the LLM says so."""
    ctx = torch.multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    run_processes(_tp_generate, [(queue,)])
    greedy = ns.SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    assert queue.get(timeout=10) == [o.token_ids for o in smol_llm.generate(TP_PROMPTS, greedy)]
    error = queue.get(timeout=10)
    print(f"after the kill: {error}")
    assert error != "no error"
    error = queue.get(timeout=10)
    print(f"after close: {error}")
    assert error == "RuntimeError: this tensor-parallel engine is closed (LLM.close())"


def test_tensor_parallel_engine_core_and_worker_death(smol_llm):
    """Served with 3 ranks behind the engine core process: the same greedy text
    as offline at TP=1; a worker killed mid-stream ends the stream with an error,
    /health turns 503, and the engine core process exits."""
    cfg = server_config(tensor_parallel_size=TP)
    client = EngineCoreClient(cfg)
    srv = ServerThread(build_app(client, cfg))
    try:
        oai = OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        text = oai.completions.create(prompt=TP_PROMPTS[0], **GREEDY_REQUEST).choices[0].text
        greedy = ns.SamplingParams(temperature=0, max_tokens=8)
        assert text == smol_llm.generate(TP_PROMPTS[0], greedy)[0].text
        with open(f"/proc/{client.process.pid}/task/{client.process.pid}/children") as f:
            workers = [int(pid) for pid in f.read().split()]
        assert len(workers) == TP - 1, workers
        stream = oai.completions.create(prompt="Write a long story about a dragon.", stream=True,
                                        **{**GREEDY_REQUEST, "max_tokens": 2000},
                                        extra_body={"ignore_eos": True})
        next(iter(stream))
        os.kill(workers[0], signal.SIGKILL)
        with pytest.raises(APIError):
            for _ in stream:
                pass
        assert httpx.get(srv.url + "/health", timeout=10).status_code == 503
        # (by /proc: the server's thread that saw the pipe close reaps it, and is_alive() in
        # the same instant can read a process another thread has just reaped as alive)
        wait_exited([client.process.pid] + workers, 30)
    finally:
        srv.stop()
        client.shutdown()




def test_cpu_threads_are_shared_among_the_ranks(monkeypatch):
    """With num_threads 0, each rank of tensor parallelism on the CPU takes its share of the
    cores it may use (at least one), not every core; a number given is kept as it is."""
    num_threads, get_num_threads = torch.get_num_threads(), torch.get_num_threads
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(12)), raising=False)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 16)   # torch's count: physical cores
    got = {}
    try:
        for size, given in [(1, 0), (3, 0), (5, 0), (16, 0), (3, 2)]:
            monkeypatch.setattr(pa, "tensor_parallel_size", lambda: size)
            pa.set_cpu_threads(given)
            got[size, given] = get_num_threads()
    finally:
        torch.set_num_threads(num_threads)
    assert got == {(1, 0): 12, (3, 0): 4, (5, 0): 2, (16, 0): 1, (3, 2): 2}, got


def test_each_engine_starts_from_the_machines_cores(monkeypatch):
    """The count an engine sets is not the next engine's start: after a rank's share at 3
    ranks, or a num_threads given, an engine with num_threads 0 at one rank takes every core."""
    threads = [16]                                   # torch's own count: 16 physical cores
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(12)), raising=False)
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads[0])
    monkeypatch.setattr(torch, "set_num_threads", lambda n: threads.__setitem__(0, n))
    got = []
    for size, given in [(3, 0), (1, 0), (1, 2), (1, 0), (3, 0), (3, 0)]:
        monkeypatch.setattr(pa, "tensor_parallel_size", lambda: size)
        pa.set_cpu_threads(given)
        got.append(threads[0])
    assert got == [4, 12, 2, 12, 4, 4], got


def fail_a_layer_once(core):
    """Runs inside the engine core process (EngineCoreClient's `setup`): rank 0's layer 10
    raises in the first step, between that step's all-reduces, so the workers stay inside it."""
    layer = core.runner.model.layers[10]

    def fail_once(*args, **kwargs):
        del layer.forward                     # the class's forward from now on
        raise RuntimeError("injected failure")
    layer.forward = fail_once


def fail_a_layer_in_the_second_step(core):
    """Runs inside the engine core process (EngineCoreClient's `setup`): the first step waits
    until two requests are queued, then rank 0's layer 10 raises in the second step, between
    that step's all-reduces. That step reads the first one back, which ends a one-token request."""
    layer, step, calls = core.runner.model.layers[10], core.step, []

    def fail_the_second_time(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("injected failure")
        return type(layer).forward(layer, *args, **kwargs)
    layer.forward = fail_the_second_time
    core.step = lambda: step() if calls or len(core.seqs) == 2 else []


def test_tensor_parallel_failed_step_ends_the_engine_core():
    """Served with 3 ranks, a step that raises on rank 0 midway through the forward pass
    leaves the ranks out of step, so it ends the engine core: the request fails with the step's
    error, the engine core and its workers exit, and /health turns 503 (no later request can
    hang). The step's outputs go out before the exit: a request that the step read back to its
    last token ends as it should."""
    cfg = server_config(tensor_parallel_size=TP, num_blocks=64)
    client = EngineCoreClient(cfg, setup=fail_a_layer_in_the_second_step)
    srv = ServerThread(build_app(client, cfg))
    try:
        with open(f"/proc/{client.process.pid}/task/{client.process.pid}/children") as f:
            workers = [int(pid) for pid in f.read().split()]
        assert len(workers) == TP - 1, workers
        post = lambda n: httpx.post(srv.url + "/v1/completions", timeout=60, json={
            "prompt": TP_PROMPTS[0], "max_tokens": n, "temperature": 0, "ignore_eos": True})
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            one, r = pool.map(post, (1, 3))
        print(one.text, r.text, sep="\n")
        assert one.status_code == 200 and one.json()["choices"][0]["finish_reason"] == "length"
        assert one.json()["usage"]["completion_tokens"] == 1
        assert r.status_code >= 500, r.text
        assert "injected failure" in r.json()["error"]["message"], r.text
        # it exits once the outputs are sent (read in /proc: the server's thread that saw the
        # pipe close reaps it, and is_alive() at that instant can read it as alive)
        wait_exited([client.process.pid] + workers, 30)
        deadline = time.time() + 10               # the server has seen the pipe close
        while httpx.get(srv.url + "/health", timeout=10).status_code != 503:
            assert time.time() < deadline, "/health does not say the engine core is gone"
            time.sleep(0.05)
    finally:
        srv.stop()
        client.shutdown()


def _tp_failed_step(queue):
    """In-process LLM at TP ranks whose layer 10 raises once on rank 0: generate twice, each
    reported with its error and time, then the workers' PIDs."""
    llm = ns.LLM(DEFAULT_MODEL, device="cpu", num_blocks=64, num_threads=1,
                 tensor_parallel_size=TP)
    fail_a_layer_once(llm.engine)
    greedy = ns.SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    for _ in range(2):
        start = time.time()
        try:
            llm.generate(TP_PROMPTS, greedy)
            queue.put(("no error", time.time() - start))
        except Exception as e:
            queue.put((f"{type(e).__name__}: {e}", time.time() - start))
    queue.put([p.pid for p in llm.engine.runner.workers.procs])
    llm.close()


def test_tensor_parallel_llm_after_a_failed_step_raises_at_once():
    """An in-process LLM at 3 ranks whose step raised on rank 0, midway through the forward
    pass: the ranks are out of step, so its workers stop. The next generate raises at once and
    says why, where it waited in broadcast_from_rank0 for gloo's 30 minutes."""
    ensure_smol()
    queue = torch.multiprocessing.get_context("spawn").Queue()
    run_processes(_tp_failed_step, [(queue,)], timeout=60)
    first, second, pids = (queue.get(timeout=10) for _ in range(3))
    print(first, second, sep="\n")
    assert first[0] == "RuntimeError: injected failure"
    assert second[0].startswith("RuntimeError: this tensor-parallel engine stopped at a step "
                                "that failed (RuntimeError('injected failure'))"), second
    assert second[1] < 2, second
    wait_exited(pids, 1)


def _tp_start_up_error_and_close(queue):
    """In a process of its own, which records its workers' PIDs: a start-up error caught
    (through the CLI's main), then an LLM at TP ranks, dropped, then the next engine."""
    pids, start = [], multiprocessing.context.SpawnProcess.start
    multiprocessing.context.SpawnProcess.start = lambda p: (start(p), pids.append(p.pid))
    try:
        ns.main(["generate", "Hi", "--device", "cpu", "--cpu-kv-cache-gb", "1e-9",
                 "--tensor-parallel-size", str(TP), "--num-threads", "1"])
    except SystemExit as e:
        queue.put(("start-up error", str(e.code), pids[:]))
    greedy = ns.SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    llm = ns.LLM(DEFAULT_MODEL, device="cpu", num_blocks=64, num_threads=1,
                 tensor_parallel_size=TP)
    first = llm.generate(TP_PROMPTS[0], greedy)[0].token_ids
    try:
        ns.LLM(DEFAULT_MODEL, device="cpu", num_blocks=64, num_threads=1)
        queue.put(("a second engine while one is open", "not refused"))
    except ValueError as e:
        queue.put(("a second engine while one is open", str(e)))
    del llm
    gc.collect()
    queue.put(("collected", pids[-2:], torch.distributed.is_initialized()))
    llm = ns.LLM(DEFAULT_MODEL, device="cpu", num_blocks=64, num_threads=1)
    queue.put(("the next engine", llm.generate(TP_PROMPTS[0], greedy)[0].token_ids == first))


def test_tensor_parallel_start_up_error_close_and_the_next_engine(capfd):
    """A start-up error every rank meets (no room for the KV cache) reaches the caller as a
    ValueError, which the CLI's main prints in one line, and the caller's process lives on: no
    worker traceback, no worker left. An LLM at TP ranks refuses a second engine while it is
    open; dropped and collected (as LLM.close does), its workers exit and its process group
    goes, so the next engine starts, and decodes the same tokens."""
    ensure_smol()
    queue = torch.multiprocessing.get_context("spawn").Queue()
    run_processes(_tp_start_up_error_and_close, [(queue,)], timeout=120)
    results = {}
    while len(results) < 4:
        what, *result = queue.get(timeout=10)
        results[what] = result
    print(results)
    error, pids = results["start-up error"]
    assert error.startswith("error: no memory left for the KV cache") and "\n" not in error
    err = capfd.readouterr().err
    assert "Traceback" not in err and "error" not in err, err   # main's line is its exit code
    assert len(pids) == TP - 1
    wait_exited(pids, 1)
    assert "still open" in results["a second engine while one is open"][0]
    pids, initialized = results["collected"]
    assert not initialized
    wait_exited(pids, 1)
    assert results["the next engine"] == [True]


def test_tensor_parallel_ctrl_c_exits_quietly():
    """Ctrl-C (SIGINT to the terminal's process group) on `generate --tensor-parallel-size 3`:
    while the workers spawn (at the first child process: multiprocessing's resource tracker
    or rank 1, before rank 2 exists), while they start, and while generating. Each time the
    process exits within seconds, without a traceback, and every process it started exits too."""
    server_config()                                  # skips without the default model
    import subprocess
    for when in ("spawning", "starting", "generating"):
        proc = subprocess.Popen(
            [sys.executable, "nanoserve.py", "generate", "Once upon a time", "--device", "cpu",
             "--tensor-parallel-size", str(TP), "--max-tokens", "500", "--ignore-eos",
             "--num-threads", "1"], cwd=os.path.dirname(os.path.abspath(__file__)),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
        try:
            children, deadline = [], time.time() + 60
            wanted = 1 if when == "spawning" else TP - 1   # the workers, and maybe the tracker
            while len(children) < wanted and time.time() < deadline:
                time.sleep(0.001)
                with open(f"/proc/{proc.pid}/task/{proc.pid}/children") as f:
                    children = [int(pid) for pid in f.read().split()]
            if when == "starting":                  # the workers import torch and join the group
                time.sleep(1)
            if when == "generating":                # the first character of the completion
                assert select.select([proc.stdout], [], [], 120)[0], "nothing generated"
                proc.stdout.read(1)
            os.killpg(proc.pid, signal.SIGINT)
            sent = time.time()
            code = proc.wait(timeout=30)
            took = time.time() - sent
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        err = proc.stderr.read().decode()
        print(f"Ctrl-C while {when}: exit code {code} after {took:.1f} s")
        assert "Traceback" not in err and "frame #" not in err, err
        assert code == 130 and took < 15, (code, took)
        wait_exited(children + in_session(proc.pid), 10)   # rank 2 too, spawned after the signal


def test_serve_ctrl_c_while_the_engine_core_starts():
    """Ctrl-C on `serve --tensor-parallel-size 3` while its engine core process imports torch,
    and once it has loaded its weights (before it tells the server it is ready): the server
    exits with code 130 within seconds, no process prints a traceback (none of
    KeyboardInterrupt in an import, nor of BrokenPipeError when the engine core reports ready
    to a server that has gone), and every process it started exits."""
    server_config()                                  # skips without the default model
    import subprocess
    for when in ("importing", "loaded"):
        proc = subprocess.Popen(
            [sys.executable, "nanoserve.py", "serve", "--device", "cpu", "--port", str(free_port()),
             "--tensor-parallel-size", str(TP), "--num-threads", "1"],
            cwd=os.path.dirname(os.path.abspath(__file__)), stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, start_new_session=True)
        try:
            if when == "importing":                 # the engine core has mapped libtorch
                torch_mapped, deadline = False, time.time() + 60
                while not torch_mapped and time.time() < deadline:
                    time.sleep(0.001)
                    with open(f"/proc/{proc.pid}/task/{proc.pid}/children") as f:
                        for child in f.read().split():
                            with open(f"/proc/{child}/maps") as maps:
                                torch_mapped = torch_mapped or "libtorch" in maps.read()
                assert torch_mapped, "no engine core importing torch"
                time.sleep(1)                       # about when triton comes after it
            else:                                   # the engine core's first line on stderr
                assert select.select([proc.stderr], [], [], 120)[0], "nothing loaded"
                assert b"loaded" in proc.stderr.readline()
            os.killpg(proc.pid, signal.SIGINT)
            sent = time.time()
            code = proc.wait(timeout=30)
            took = time.time() - sent
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        wait_exited(in_session(proc.pid), 10)      # the engine core ends with its server
        err = proc.stderr.read().decode()
        print(f"Ctrl-C while {when}: exit code {code} after {took:.1f} s")
        assert "Traceback" not in err, err
        assert code == 130 and took < 15, (code, took)


def children_of(pid: int) -> list:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(child) for child in f.read().split()]
    except FileNotFoundError:
        return []


def ignores_sigint(pid: int) -> bool:
    """Whether process pid ignores SIGINT (its SigIgn mask in /proc), as follow_parent makes
    the engine core and the workers do."""
    try:
        with open(f"/proc/{pid}/status") as f:
            mask = next(int(line.split()[1], 16) for line in f if line.startswith("SigIgn:"))
    except FileNotFoundError:
        return False
    return bool(mask >> (signal.SIGINT - 1) & 1)


def test_serve_ctrl_c_while_the_engine_core_loads():
    """Ctrl-C on `serve --tensor-parallel-size 3` once the engine core ignores SIGINT: while
    its workers import torch, and once they ignore SIGINT too and load. The server exits with
    code 130 within 3 s, without a traceback, and every process it started is gone 3 s later,
    none having loaded its weights. (The server waited at exit until every rank had loaded.)"""
    server_config()                                  # skips without the default model
    import subprocess
    for when in ("importing", "loading"):
        proc = subprocess.Popen(
            [sys.executable, "nanoserve.py", "serve", "--device", "cpu", "--port", str(free_port()),
             "--tensor-parallel-size", str(TP), "--num-threads", "1"],
            cwd=os.path.dirname(os.path.abspath(__file__)), stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, start_new_session=True)
        try:
            moment, deadline = False, time.time() + 60
            while not moment and time.time() < deadline:
                time.sleep(0.005)
                core = [c for c in children_of(proc.pid) if len(children_of(c)) == TP - 1]
                workers = children_of(core[0]) if core else []
                moment = bool(workers) and ignores_sigint(core[0]) and \
                    any(map(ignores_sigint, workers)) == (when == "loading")
            assert moment, f"no engine core with workers {when}"
            os.killpg(proc.pid, signal.SIGINT)
            sent = time.time()
            code = proc.wait(timeout=30)
            took = time.time() - sent
            wait_exited(in_session(proc.pid), 3)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        err = proc.stderr.read().decode()
        print(f"Ctrl-C while the workers are {when}: exit code {code} after {took:.1f} s")
        assert "Traceback" not in err and "loaded" not in err, err
        assert code == 130 and took < 3, (code, took)


TP_CUDA_PROMPTS = [list(range(5, 16)), [20, 21, 22], list(range(30, 180)), list(range(200, 290))]


def _tp_cuda_generate(path, tp, eager, queue):
    llm = ns.LLM(path, device="cuda", dtype="float32", tensor_parallel_size=tp, enforce_eager=eager,
                 num_blocks=64, block_size=8, max_num_batched_tokens=48, max_num_seqs=4)
    params = ns.SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    queue.put([o.token_ids for o in llm.generate(TP_CUDA_PROMPTS, params)])


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_tensor_parallel_cuda_equals_tp1(tmp_path):
    """On two GPUs (NCCL), fp32: TP=2 with CUDA graphs (the all-reduces captured)
    and TP=2 eager give the tokens of TP=1, on a tiny random model with 2 KV heads."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(
        hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, vocab_size=512, max_position_embeddings=512,
        rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)).eval()
    with torch.no_grad():   # larger weights than the default init, so outputs vary per token
        for p in hf.parameters():
            p.normal_(0, 0.3) if p.dim() > 1 else p.uniform_(0.5, 1.5)
    hf.save_pretrained(str(tmp_path))
    queue = torch.multiprocessing.get_context("spawn").Queue()
    outs = {}
    for tp, eager in ((1, False), (2, False), (2, True)):
        run_processes(_tp_cuda_generate, [(str(tmp_path), tp, eager, queue)])
        outs[tp, eager] = queue.get(timeout=10)
    assert outs[2, False] == outs[1, False]
    assert outs[2, True] == outs[1, False]


def test_tensor_parallel_size_must_divide_the_heads(capsys):
    """SmolLM2's 3 KV heads do not split over 2 ranks: a ValueError before any
    process starts, and one line from the CLI."""
    ensure_smol()
    with pytest.raises(ValueError, match="must divide the model's 9 query heads, 3 KV heads"):
        ns.LLM(DEFAULT_MODEL, device="cpu", tensor_parallel_size=2)
    with pytest.raises(SystemExit) as e:
        ns.main(["generate", "Hi", "--device", "cpu", "--tensor-parallel-size", "2"])
    assert str(e.value.code).startswith("error: tensor_parallel_size 2 must divide")
    assert "\n" not in str(e.value.code)


# ---------------------------------------------------------------------------
# fp8 weights (quantization="fp8"): the kernels against their references, the
# quality of the real model against its unquantized self, tensor parallelism,
# and the inputs refused

FP8_DEVICES = pytest.mark.parametrize("device", [
    pytest.param("cpu", marks=pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1")),
    pytest.param("cuda", marks=pytest.mark.skipif(NO_CUDA, reason="needs CUDA"))])


@pytest.fixture
def exact_fp8_casts(monkeypatch):
    """Triton's interpreter rounds fp32 to e4m3 without carrying into the exponent (125.3 becomes
    64, not 128). There, such casts go through torch's instead, so that a kernel which quantizes
    can be held to fp32's tolerance."""
    if not INTERPRET:
        return
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter
    convert = interpreter._convert_float

    def cast(x, from_dtype, to_dtype, rounding):
        if (from_dtype, to_dtype) != (tl.float32, tl.float8e4nv):
            return convert(x, from_dtype, to_dtype, rounding)
        return torch.from_numpy(x.astype(np.float32)).to(pa.FP8).view(torch.uint8).numpy()
    monkeypatch.setattr(interpreter, "_convert_float", cast)


@FP8_DEVICES
@pytest.mark.parametrize("norm,silu_mul,residual", [(True, False, False), (False, True, True)])
@pytest.mark.parametrize("config", [(16, 32, 3, 4), (8, 64, 1, 4)])
def test_gemv_fp8(device, norm, silu_mul, residual, config, monkeypatch):
    """The GEMV on e4m3 weights (with and without split-K) against
    gemv_ref on the same e4m3 values and scales, in bf16. quantize_fp8 keeps each
    row's largest magnitude at 448 and rounds every weight to within 1/16."""
    monkeypatch.setattr(pa, "_gemv_config_fp8", lambda N, K: config)
    gen = torch.Generator().manual_seed(len(config))
    M, N, K = 1, 40, 160
    w = torch.randn(N, K, generator=gen) / K ** 0.5
    q = pa.quantize_fp8(w.to(device))
    assert q.dtype == pa.FP8 and q.scale.shape == (N,) and not q.requires_grad
    assert torch.equal(q.float().abs().amax(1).cpu(), torch.full((N,), 448.0))
    worst = ((q.float() * q.scale[:, None]).cpu() - w).abs().max() / w.abs().max()
    assert worst <= 1 / 16, f"weight rounding {worst:.3f}"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32  # the interpreter lacks bf16 math
    rand = lambda *shape: torch.randn(*shape, generator=gen).to(device, dtype)  # noqa: E731
    x = rand(M, 2 * K if silu_mul else K)
    norm_w, res = (rand(K) if norm else None), (rand(M, N) if residual else None)
    up = lambda t: None if t is None else t.float()  # noqa: E731
    ref = pa.gemv_fp8_ref(x.float(), q, up(norm_w), 1e-5, silu_mul, up(res))
    out = pa.gemv(x, q, norm_w, 1e-5, silu_mul, res, scale=q.scale)
    compare(out, ref, dtype, f"gemv fp8 {config} norm={norm} silu={silu_mul}")
    assert (pa._split_k_counts(out.device) == 0).all(), "split-K counts not reset"


@FP8_DEVICES
@pytest.mark.parametrize("norm,silu_mul,residual", [(True, False, False), (False, True, True)])
@pytest.mark.parametrize("config", [(16, 32, 3, 4, 2), (32, 64, 1, 4, 3)])
@pytest.mark.parametrize("M", [1, 5, 16])
def test_skinny_matmul_fp8(device, norm, silu_mul, residual, config, M, monkeypatch,
                           exact_fp8_casts):
    """The skinny matmul on e4m3 weights (with and without split-K) against gemv_ref on
    the same e4m3 values and scales, with x through e4m3 in runs of BLOCK_K columns as
    the kernel's dot takes it (x_group); in bf16 on the GPU."""
    monkeypatch.setattr(pa, "_skinny_config", lambda N, K, fp8, M: config)
    gen = torch.Generator().manual_seed(len(config) + M)
    N, K = 40, 160
    w = torch.randn(N, K, generator=gen) / K ** 0.5
    q = pa.quantize_fp8(w.to(device))
    dtype = torch.bfloat16 if device == "cuda" else torch.float32  # the interpreter lacks bf16 math
    rand = lambda *shape: torch.randn(*shape, generator=gen).to(device, dtype)  # noqa: E731
    x = rand(M, 2 * K if silu_mul else K)
    norm_w, res = (rand(K) if norm else None), (rand(M, N) if residual else None)
    up = lambda t: None if t is None else t.float()  # noqa: E731
    ref = pa.gemv_fp8_ref(x.float(), q, up(norm_w), 1e-5, silu_mul, up(res),
                          x_group=config[1])
    out = pa.skinny_matmul(x, q, norm_w, 1e-5, silu_mul, res, scale=q.scale)
    compare(out, ref, dtype, f"skinny fp8 M={M} {config} norm={norm} silu={silu_mul}")
    assert (pa._split_k_counts(out.device) == 0).all(), "split-K counts not reset"


@FP8_DEVICES
@pytest.mark.parametrize("norm,silu_mul", [(False, False), (True, False), (False, True)])
def test_quantize_rows(device, norm, silu_mul):
    """Per-token quantization of the batched fp8 matmul's input against
    quantize_rows_ref: the same scales, and values within one e4m3 step (the
    prologue's rounding may tip a value over a rounding boundary)."""
    gen = torch.Generator().manual_seed(3)
    M, K = 5, 96
    dtype = torch.bfloat16 if device == "cuda" else torch.float32  # the interpreter lacks bf16 math
    x = (3 * torch.randn(M, 2 * K if silu_mul else K, generator=gen)).to(device, dtype)
    norm_w = torch.rand(K, generator=gen).to(device, dtype) if norm else None
    q, s = pa.quantize_rows(x, norm_w, 1e-5, silu_mul)
    q_ref, s_ref = pa.quantize_rows_ref(x, norm_w, 1e-5, silu_mul)
    assert q.dtype == pa.FP8 and s.shape == (M, 1)
    assert torch.allclose(s, s_ref, rtol=1e-4), (s, s_ref)
    a, b = q.float(), q_ref.float()        # e4m3 steps: 1/8 of the value, 2^-9 below 2^-6
    off = (a - b).abs() > torch.maximum(b.abs() / 8, torch.full_like(b, 2.0 ** -9))
    if device == "cpu":  # the interpreter casts a value just under a power of two to half of it
        off &= ~((2 * a == b) & (b.abs().log2() == b.abs().log2().round()))  # (125.3: 64, not 128)
    print(f"quantize_rows: {int(off.sum())} values beyond one e4m3 step, "
          f"{(a != b).float().mean():.1%} differ")
    assert not off.any() and (a != b).float().mean() < 0.1


@pytest.mark.skipif(NO_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("M", [1, 2, 16, 64, 300])
@pytest.mark.parametrize("N,K", [(3072, 2048), (2048, 8192), (4096, 14336)])
def test_linear_fp8_cuda(M, N, K):
    """pa.linear on fp8 weights (the GEMV at one row, the skinny matmul up to 16,
    quantize_rows and _scaled_mm beyond) against the exact product with the
    unquantized weight: the error is fp8's own, about 2.6% of the output's norm
    from the weights alone, more with x quantized too."""
    gen = torch.Generator().manual_seed(M)
    x = torch.randn(M, K, generator=gen).to("cuda", torch.bfloat16)
    w = (torch.randn(N, K, generator=gen) / K ** 0.5).to("cuda", torch.bfloat16)
    q = pa.quantize_fp8(w)
    ref = F.linear(x.float(), w.float())
    err = ((pa.linear(x, q).float() - ref).norm() / ref.norm()).item()
    err_ref = ((pa.linear_fp8_ref(x.float(), q, q.scale) - ref).norm() / ref.norm()).item()
    print(f"fp8 linear {M}x{N}x{K}: error {err:.3f} (weights alone {err_ref:.3f})")
    assert err < 0.04


FP8_TEXT_TOKENS = 512


def fp8_layer_outputs_and_logprobs(quantization, ids):
    """One prefill of ids through the real model: each layer's output and the log-probs."""
    T = len(ids)
    cfg = ns.Config(model=ensure_smol(), device="cpu", num_blocks=T // 16 + 1,
                    quantization=quantization)
    model = ns.build_model(cfg)
    ns.quantize_fp8_weights(model, cfg)                # as Fp8WeightsRunner.load_model
    for layer in model.layers:
        shape = (T // 16 + 1, 16, cfg.num_kv_heads, cfg.head_dim)
        layer.attn.k_cache, layer.attn.v_cache = torch.zeros(shape), torch.zeros(shape)
    outputs = []
    for layer in model.layers:
        layer.register_forward_hook(lambda m, i, o: outputs.append(o))
    with torch.no_grad():
        logprobs = model.compute_logits(model(torch.tensor(ids), torch.arange(T),
                                              prefill_meta(T)))[:-1].log_softmax(-1)
    return outputs, logprobs


def fp8_activations_of_skinny(x, weight):
    """x as the skinny matmul quantizes it: in runs of its BLOCK_K columns."""
    return pa.fp8_activations_ref(x, pa._skinny_config(*weight.shape, True, 2)[1])


# The per-token path's rise, by the matmul quantized per token alone (README, fp8 weights): qkv,
# o, gate_up, down +2.52, +2.88, +2.72, +2.98% against the weights' +2.56%, all four +4.26%.
@pytest.mark.parametrize("activations", [None, pytest.param("per token", marks=pytest.mark.xfail(
    strict=True, reason="one scale per token (quantize_rows and _scaled_mm, past 16 rows) costs "
                        "SmolLM2-135M +4.2% perplexity and 9.5% at its worst layer")), "skinny"])
def test_fp8_quality_smol(activations, monkeypatch):
    """SmolLM2-135M with fp8 weights against itself unquantized, teacher-forced
    over a fixed text (Python's own pydoc topics): perplexity at most 4% higher,
    the top token the same at >= 90% of positions, and every layer's residual
    stream within 8% (relative norm) of the unquantized one. For each fp8 path:
    the weights alone (the GEMV at one row, and the CPU), x quantized per token
    too (quantize_rows and _scaled_mm past 16 rows), and x quantized per run of
    BLOCK_K columns (the skinny matmul)."""
    from pydoc_data.topics import topics
    text = "".join(topics[k] for k in sorted(topics))
    ids = ns.load_tokenizer(ensure_smol())[0].encode(text[:8 * FP8_TEXT_TOKENS]).ids
    ids = ids[:FP8_TEXT_TOKENS]
    assert len(ids) == FP8_TEXT_TOKENS
    h_ref, lp_ref = fp8_layer_outputs_and_logprobs(None, ids)
    quantize_x = {None: lambda x, weight: x, "skinny": fp8_activations_of_skinny,
                  "per token": lambda x, weight: pa.fp8_activations_ref(x, x.shape[1])}[activations]
    weights_alone = pa.linear_fp8_ref
    monkeypatch.setattr(pa, "linear_fp8_ref", lambda x, weight, scale: weights_alone(
        quantize_x(x, weight), weight, scale))                  # what pa.linear runs on the CPU
    h_fp8, lp_fp8 = fp8_layer_outputs_and_logprobs("fp8", ids)
    layer_err = [((a - b).norm() / b.norm()).item() for a, b in zip(h_fp8, h_ref)]
    targets = torch.tensor(ids[1:])[:, None]
    nll_ref, nll_fp8 = (-lp.gather(1, targets).mean() for lp in (lp_ref, lp_fp8))
    rise = (nll_fp8 - nll_ref).exp().item() - 1
    agree = (lp_fp8.argmax(-1) == lp_ref.argmax(-1)).float().mean().item()
    print(f"fp8 ({activations or 'weights alone'}) on {len(ids)} tokens: perplexity "
          f"{nll_ref.exp():.3f} -> {nll_fp8.exp():.3f} (+{rise:.2%}), greedy agreement {agree:.1%}, "
          f"worst layer {max(layer_err):.3f} (layer {layer_err.index(max(layer_err))})")
    assert rise <= 0.04 and agree >= 0.90 and max(layer_err) <= 0.08


@torch.no_grad()
def test_fp8_keeps_the_biases_and_head_norms(qwen2, qwen3):
    """fp8 quantizes the matmul weights only: Qwen2's q, k and v bias and Qwen3's per-head norms
    stay in the model's dtype. So the fp8 model computes what the fp32 model computes with each
    weight replaced by its fp8 value times its scale."""
    ids = torch.arange(5, 45)
    for path, _ in (qwen2, qwen3):
        (cfg, fp8), (_, ref) = (ours_and_hf(path, None, quantization=q) for q in ("fp8", None))
        for mine, theirs in zip(fp8.layers.modules(), ref.layers.modules()):
            if isinstance(mine, torch.nn.Linear):
                theirs.weight.copy_(mine.weight.float() * mine.weight.scale[:, None])
        attn = fp8.layers[0].attn
        kept = [attn.qkv_proj.bias] if cfg.qkv_bias else [attn.q_norm.weight, attn.k_norm.weight]
        assert attn.qkv_proj.weight.dtype == pa.FP8 and {t.dtype for t in kept} == {torch.float32}
        out = [m(ids, torch.arange(40), prefill_meta(40)) for m in (fp8, ref)]
        assert_close(f"fp8 against its widened weights, {cfg.model}", *out, 1e-5)


def _fp8_sharded_rank(rank, port):
    """One of TP ranks with fp8 weights: each weight is its own slice quantized
    (o_proj and down_proj, row-parallel, have the scales of the rank's columns,
    not of whole rows), and the layers with their all-reduces stay within fp8's
    error of the unsharded fp8 layers."""
    from safetensors.torch import load_file
    torch.set_num_threads(1)
    T = 24
    x = torch.randn(T, 576, generator=torch.Generator().manual_seed(1))
    outputs = {}
    for tp in (1, TP):
        if tp > 1:
            ns._init_group("cpu", rank, tp, port)
        cfg = Config(model=DEFAULT_MODEL, device="cpu", num_blocks=64, tensor_parallel_size=tp,
                     quantization="fp8")
        model = ns.build_shard(cfg)
        ns.quantize_fp8_weights(model, cfg)            # as DefaultRunner.load_model
        attn = model.layers[0].attn
        shape = (64, 16, cfg.num_kv_heads // tp, cfg.head_dim)  # (num_blocks, block_size, n_kv, hd)
        attn.k_cache, attn.v_cache = torch.zeros(shape), torch.zeros(shape)
        with torch.no_grad():
            outputs[tp] = (attn(x, torch.arange(T), model.rope, prefill_meta(T)),
                           model.layers[0].mlp(x, residual=x))
    checkpoint = load_file(os.path.join(DEFAULT_MODEL, "model.safetensors"))
    for key, ours in (("self_attn.o_proj", attn.o_proj.weight),
                      ("mlp.down_proj", model.layers[0].mlp.down_proj.weight),
                      ("self_attn.q_proj", attn.qkv_proj.weight)):   # q: qkv's first rows
        key = f"model.layers.0.{key}.weight"
        want = pa.quantize_fp8(pa.shard(checkpoint[key].float(), key, TP))
        n = want.shape[0]
        assert torch.equal(ours[:n].float(), want.float()) and torch.equal(ours.scale[:n], want.scale), key
    for i, what in enumerate(("attention", "MLP + residual")):
        assert_close(f"fp8 {what}, rank {rank} of {TP}", outputs[TP][i], outputs[1][i], 3e-2)


def test_tensor_parallel_fp8_quantizes_each_slice():
    """fp8 weights over 3 gloo ranks: shard first, then quantize (see _fp8_sharded_rank)."""
    ensure_smol()
    port = free_port()
    run_processes(_fp8_sharded_rank, [(rank, port) for rank in range(TP)])


def test_fp8_bad_input(tmp_path, capsys):
    """An unknown quantization is a ValueError listing the values (one line from
    the CLI); a checkpoint stored quantized (compressed-tensors, as vLLM reads it)
    is refused by name before a byte of it is read."""
    ensure_smol()
    with pytest.raises(ValueError, match=r"quantization must be one of \(None, 'fp8'\), got 'int4'"):
        ns.LLM(DEFAULT_MODEL, device="cpu", quantization="int4")
    with pytest.raises(SystemExit) as e:
        ns.main(["generate", "Hi", "--device", "cpu", "--quantization", "int4"])
    assert str(e.value.code).startswith("error: quantization must be one of") \
        and "\n" not in str(e.value.code)
    with open(os.path.join(DEFAULT_MODEL, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = {"quant_method": "compressed-tensors", "format": "float-quantized",
                                     "config_groups": {"group_0": {"weights": {"num_bits": 8,
                                                                               "type": "float",
                                                                               "strategy": "channel"}}}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "model.safetensors").write_bytes(b"not read")
    with pytest.raises(ValueError, match=r"stored quantized \(compressed-tensors, format "
                                         r"'float-quantized'\) is not supported"):
        ns.LLM(str(tmp_path), device="cpu", quantization="fp8")


# ---------------------------------------------------------------------------
# fp8 KV cache (kv_cache_dtype="fp8"): the store and attention kernels and the
# CPU path against their references on an e4m3 pool, the engine's invariants on
# it, the quality of the real model against its usual pool, and the inputs refused

def as_bytes(t):
    return t.view(torch.uint8)


@FP8_DEVICES
def test_store_kvcache_fp8(device, exact_fp8_casts):
    """New K/V into an e4m3 pool: the kernel writes the reference's bytes (and so does the CPU
    path), clamping a value past 448 to 448, and leaves every other slot as it was."""
    gen = torch.Generator().manual_seed(0)
    N_tok, n_kv, hd, block_size = 9, 2, 64, 8
    _, k, v = fused_qkv_views(N_tok, 2 * n_kv, n_kv, hd, torch.float32, device, gen)
    k[0, 0, :3] = torch.tensor([500.0, -1e4, 0.3])
    slot_mapping, k_cache, v_cache = random_pool(4, block_size, n_kv, hd, N_tok, 3, torch.float32,
                                                 device, gen)
    k_cache, v_cache = k_cache.to(pa.FP8), v_cache.to(pa.FP8)
    k_ref, v_ref, k_before = k_cache.clone(), v_cache.clone(), k_cache.clone()
    pa.store_kvcache_ref(k, v, k_ref, v_ref, slot_mapping)
    pa.store_kvcache(k, v, k_cache, v_cache, slot_mapping)
    assert torch.equal(as_bytes(k_cache), as_bytes(k_ref))
    assert torch.equal(as_bytes(v_cache), as_bytes(v_ref))
    stored = k_cache.view(-1, n_kv, hd)[slot_mapping[0], 0, :3].float().tolist()
    print(f"500, -1e4, 0.3 stored as {stored}")
    assert stored == [448.0, -448.0, 0.3125]
    changed = (as_bytes(k_cache) != as_bytes(k_before)).flatten(2).any(-1).flatten()
    assert set(changed.nonzero().flatten().tolist()) <= set(slot_mapping.tolist())
    if device == "cpu":   # the sdpa path, which has no padding tokens
        valid = slot_mapping >= 0
        pa.store_kvcache_sdpa(k[valid], v[valid], k_before, v_cache, slot_mapping[valid])
        assert torch.equal(as_bytes(k_before), as_bytes(k_ref))


@DEVICE_DTYPES
def test_rope_store_kvcache_fp8(device, dtype, exact_fp8_casts):
    """RoPE fused into the store, into an e4m3 pool: q as the reference rotates it, v stored to
    the reference's bytes (values past 448 clamped), k rotated, rounded to q's dtype, then to
    e4m3 as the reference does it (within fp32 rounding: a rare value may land one e4m3 step
    apart, so the pools are compared as bf16 values are)."""
    gen = torch.Generator().manual_seed(3)
    N_tok, n_heads, n_kv, hd = 7, 9, 3, 64
    q, k, v = fused_qkv_views(N_tok, n_heads, n_kv, hd, dtype, device, gen)
    k, v = k * 100, v * 300            # some of v past 448
    positions = torch.randint(0, 100, (N_tok,), generator=gen).to(device)
    freqs = torch.outer(torch.arange(100.0), torch.rand(hd // 2, generator=gen))  # (100, hd/2)
    cos, sin = freqs.cos().to(device), freqs.sin().to(device)
    slot_mapping, k_cache, v_cache = random_pool(4, 8, n_kv, hd, N_tok, 2, dtype, device, gen)
    k_cache, v_cache = k_cache.to(pa.FP8), v_cache.to(pa.FP8)
    k_ref, v_ref, q_ref = k_cache.clone(), v_cache.clone(), q.clone()
    pa.rope_store_kvcache_ref(q_ref, k, v, k_ref, v_ref, slot_mapping, positions, cos, sin)
    pa.rope_store_kvcache(q, k, v, k_cache, v_cache, slot_mapping, positions, cos, sin)
    assert (v.abs() > 448).any() and torch.equal(as_bytes(v_cache), as_bytes(v_ref))
    compare(q, q_ref, dtype, "rotated q, fp8 pool")
    differ = (as_bytes(k_cache) != as_bytes(k_ref)).sum().item()
    print(f"k in the fp8 pool: {differ} of {k_ref.numel()} bytes unlike the reference's")
    compare(k_cache.float(), k_ref.float(), torch.bfloat16, "rotated k in the fp8 pool")


@DEVICE_DTYPES
@pytest.mark.parametrize("n_heads,n_kv,hd,block_size", [(9, 3, 128, 8), (8, 2, 64, 32)])
def test_attention_fp8_kv_cache(device, dtype, n_heads, n_kv, hd, block_size):
    """Decode (splits merged by the last) and mixed prefill over an e4m3 pool, against the
    references over the same values widened to fp32: the kernels widen as they load, so the
    tolerance is that of a pool in q's dtype."""
    bs = block_size
    out, ref = run_decode([0, 1, bs - 1, bs + 1, 67, 300], n_heads, n_kv, hd, bs, device, dtype,
                          kv_dtype=pa.FP8)
    compare(out, ref, dtype, f"decode over an fp8 pool {n_heads}/{n_kv} hd{hd} bs{bs}")
    out, ref = run_decode([1000, 130, 0], 4, 1, 64, 16, device, dtype, kv_dtype=pa.FP8)
    compare(out, ref, dtype, "decode over an fp8 pool, split as in test_decode_last_split_merges")
    out, ref = run_prefill_mixed(n_heads, n_kv, hd, bs, device, dtype, kv_dtype=pa.FP8)
    compare(out, ref, dtype, f"prefill over an fp8 pool {n_heads}/{n_kv} hd{hd} bs{bs}")


@CPU_DTYPES
def test_sdpa_fp8_kv_cache(dtype):
    """The CPU path over an e4m3 pool, against the references: ragged decode rows (a gather), a
    lone sequence (read in place, then widened), and mixed prefill."""
    for lens in ([1, 15, 16, 17, 67, 131], [131]):
        out, ref = run_decode(lens, 8, 2, 64, 16, "cpu", dtype, kv_dtype=pa.FP8,
                              decode=pa.paged_attention_decode_sdpa)
        compare(out, ref, dtype, f"decode sdpa over an fp8 pool, L={lens}")
    out, ref = run_prefill_mixed(9, 3, 128, 8, "cpu", dtype, kv_dtype=pa.FP8,
                                 prefill=pa.paged_attention_prefill_sdpa)
    compare(out, ref, dtype, "prefill sdpa over an fp8 pool")


def test_fp8_kv_cache_engine_invariants(capsys):
    """The engine on an e4m3 pool (CPU, fp32 weights) with chunked prefill (16-token budget),
    drafts, prefix caching (a second pass finds the prompts cached) and preemption (9 blocks
    of 8): greedy batched output equals one prompt at a time, and every block is back in the
    pool. The start-up line tells the pool's size and dtype."""
    prompts = COPY_PROMPTS + SMOL_PROMPTS[:2]
    params = ns.SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    common = dict(device="cpu", kv_cache_dtype="fp8", max_num_batched_tokens=16, max_num_seqs=4,
                  num_speculative_tokens=3)
    big = ns.LLM(ensure_smol(), num_blocks=64, **common)
    small = ns.LLM(SMOL_DIR, num_blocks=9, block_size=8, enable_prefix_caching=False, **common)
    assert "KV cache: 9 blocks of 8 tokens, 72 tokens, torch.float8_e4m3fn" in capsys.readouterr().err
    assert big.engine.runner.model.layers[0].attn.k_cache.dtype == pa.FP8
    alone = [big.generate([p], params)[0].token_ids for p in prompts]
    for llm in (big, small):
        assert [o.token_ids for o in llm.generate(prompts, params)] == alone
        check_pool_is_free(llm.engine)
    stats, preempted = big.stats(), small.stats()["preemptions_total"]
    hits, drafted = stats["prefix_cache_hit_tokens_total"], stats["spec_decode_num_draft_tokens_total"]
    print(f"fp8 pool: {hits} prefix-cache hit tokens, {preempted} preemptions, {drafted} drafts")
    assert hits > 0 and preempted > 0 and drafted > 0


def test_tensor_parallel_fp8_kv_cache(qwen3):
    """Over 2 gloo ranks, each rank's e4m3 pool holding its KV head: greedy tokens with drafts
    equal one rank's on an e4m3 pool."""
    path, _ = qwen3
    queue = torch.multiprocessing.get_context("spawn").Queue()
    _family_generate(path, 1, queue, "fp8")
    run_processes(_family_generate, [(path, 2, queue, "fp8")])
    assert queue.get(timeout=10) == queue.get(timeout=10)


def test_fp8_kv_cache_quality_smol(capsys):
    """SmolLM2-135M (fp32 weights) with its pool in e4m3 against its usual fp32 pool,
    teacher-forced through prompt_logprobs over test_fp8_quality_smol's text: perplexity at most
    2% higher, the top token the same at >= 93% of positions. e4m3 keeps 3 mantissa bits
    whatever the scale: scales of 1/4, 1/16 and a per-layer absmax one measured no better
    than 1.0 (the mean KL divergence stays at 0.009), and the issue's 1% is not met. The text is
    Python's own help topics, which differ by Python release: +1.18% and 94.1% on the release
    this was first measured on, +1.77% and 95.1% on 3.11.7."""
    from pydoc_data.topics import topics
    text = "".join(topics[k] for k in sorted(topics))
    ids = ns.load_tokenizer(ensure_smol())[0].encode(text[:8 * FP8_TEXT_TOKENS]).ids
    ids = ids[:FP8_TEXT_TOKENS]
    params = ns.SamplingParams(max_tokens=1, prompt_logprobs=1)
    runs = {}
    for kv in ("auto", "fp8"):
        llm = ns.LLM(SMOL_DIR, device="cpu", kv_cache_dtype=kv, num_blocks=FP8_TEXT_TOKENS // 16 + 1)
        runs[kv] = llm.generate([ids], params)[0].prompt_logprobs
        check_pool_is_free(llm.engine)
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("KV cache")]
    assert lines == [f"KV cache: 33 blocks of 16 tokens, 528 tokens, torch.{t}"
                     for t in ("float32", "float8_e4m3fn")]
    (lp_ref, top_ref), (lp_fp8, top_fp8) = (
        (torch.tensor([lp for lp, _ in r]), [next(iter(top)) for _, top in r])
        for r in (runs["auto"], runs["fp8"]))
    rise = (lp_ref.mean() - lp_fp8.mean()).exp().item() - 1
    agree = sum(a == b for a, b in zip(top_ref, top_fp8)) / len(top_ref)
    print(f"fp8 KV cache on {len(ids)} tokens: perplexity {(-lp_ref.mean()).exp():.3f} -> "
          f"{(-lp_fp8.mean()).exp():.3f} (+{rise:.2%}), greedy agreement {agree:.1%}")
    assert rise <= 0.02 and agree >= 0.93


def test_fp8_kv_cache_bad_input(monkeypatch):
    """An unknown kv_cache_dtype is a ValueError listing the values (one line from the CLI);
    fp8 on a GPU below compute capability 8.9 is refused by name."""
    ensure_smol()
    with pytest.raises(ValueError, match=r"kv_cache_dtype must be one of \('auto', 'fp8'\), "
                                         r"got 'fp16'"):
        ns.Config(device="cpu", kv_cache_dtype="fp16")
    with pytest.raises(SystemExit) as e:
        ns.main(["generate", "Hi", "--device", "cpu", "--kv-cache-dtype", "fp16"])
    assert str(e.value.code).startswith("error: kv_cache_dtype must be one of") \
        and "\n" not in str(e.value.code)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setenv("TRITON_INTERPRET", "1")     # past the check that cuda is there
    with pytest.raises(ValueError, match="kv_cache_dtype fp8 needs compute capability 8.9"):
        ns.check_fp8_kv_cache(ns.Config(device="cuda", kv_cache_dtype="fp8"))  # Fp8KVCacheRunner's
    ns.check_fp8_kv_cache(ns.Config(device="cuda"))     # the model's dtype: no such need
