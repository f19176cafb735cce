"""
Paged attention kernels for nanoserve, in Triton, each next to a plain torch
reference that computes the same thing.

Serving keeps the keys and values of every running sequence in one pool of fixed-size blocks (the
paged KV cache) instead of one long tensor per sequence, so memory is handed out block by block and
never fragments. A sequence finds its tokens through its `block_table`, the list of block ids it
owns in order. This file holds the kernels that touch that pool:

    store_kvcache            write this step's new K/V into their slots (e4m3 in an fp8 pool)
    paged_attention_decode   one query token per sequence (flash-decoding)
    paged_attention_prefill  many query tokens per sequence, causal, varlen; also serves
                             chunked prefill and decode rows
    rope_store_kvcache       RoPE on q and k fused into store_kvcache
    rms_norm, silu_and_mul   the layers' elementwise steps, one launch each
    quantize_fp8, quantize_rows
                             fp8 weights: e4m3 with a scale per output channel, and a batch's
                             activations quantized per token for torch._scaled_mm (linear chooses)
    norm, linear, ATTENTION  which of these (or of the torch versions) the engine calls, chosen
                             in the first section (linear's in linear_impl, after the skinny
                             matmul; ATTENTION in the last)
    cuda_graph_sizes, graph_key
                             which CUDA graphs are captured, and which one replays a step
    apply_token_mask         a grammar's mask applied to the logits in place, in one launch
                             (nanoserve's structured-output chapter fills the masks)
    shard, min_over_ranks    tensor parallelism's primitives: a rank's cut of each weight, and
                             the pool's size over the ranks (nanoserve's tensor-parallelism
                             chapter runs the ranks and sums o's and down's partial products)

and, for decode, a GEMV (one-row matmul) and a skinny matmul (up to 16 rows, one read of the weight
for all of them) that apply RMSNorm or SiLU-and-mul to their input and add the residual to their
output.

Each kernel reads K/V straight from the pool through the block table (K/V are never gathered or
repeated for grouped-query attention), and each wrapper only launches work sized from static
shapes: no host sync, so the engine captures every step's forward pass, decode steps and steps with
prompt tokens alike, in CUDA graphs.

Without a GPU the engine runs the `*_sdpa` functions near the end of the file instead: torch's CPU
flash attention over K/V read from the same pool.

Left out on purpose: sliding windows, ALiBi, logit soft-capping, head dims not a power of two.

Checked against the plain torch references in this file (the Triton kernels and the CPU path alike)
by the kernel tests:

    TRITON_INTERPRET=1 pytest -q test_nanoserve.py    # CPU, Triton interpreter
    pytest -q test_nanoserve.py                       # GPU, bf16

Dimension letters, used in every shape comment:
    B           sequences in the batch
    N_tok       new tokens of this step, all sequences flattened
    n_heads     query heads; n_kv key/value heads; G = n_heads // n_kv
    hd          head dim
    num_blocks  blocks in the pool; block_size tokens per block
    max_blocks  width of the block table (the batch's longest sequence, in blocks)
    L           context length of one sequence (cached + new tokens)
    T           new (query) tokens of one sequence
"""

import bisect
import functools
import os

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
import triton
import triton.language as tl

# ----------------------------------------------------------------------------
# What the engine calls, and what each call computes
# The contracts first: each kernel's plain torch reference, which computes the same thing one
# sequence or one op at a time. The tests hold every implementation to these. Then what the
# engine calls, by caller:
#     the layers             norm, linear (its kernel chosen in linear_impl)
#     each Attention layer   a (rope_store, attend) pair of ATTENTION (the last section)
#     the sampler            argmax_rows, apply_token_mask, apply_top_k_top_p,
#                            apply_logit_edits (its host half: logit_edit_entries)
#     the model runner       to_device, put, cuda_graph_sizes, graph_key, set_cpu_threads
#     speculative decoding   follow_accepted
# On the GPU they run Triton kernels (cuBLAS for matmuls of several rows); on the CPU, the torch
# references and SDPA. rope_store rotates q in place and writes the rotated k, and v, into the
# pool. attend reads the pool through the step's AttentionMetadata, as decode when every
# sequence brings one token.

# -- the layers' (the reading path's stop 3: from here to linear) --
# (AttentionMetadata, in nanoserve's Layers, defines the four tensors by example.)

def _gather_kv_ref(cache, block_table, L):
    """The first L tokens of one sequence, gathered through its block table."""
    num_blocks = -(-L // cache.shape[1])
    return cache[block_table[:num_blocks].long()].flatten(0, 1)[:L]  # (L, n_kv, hd)


def _attend_ref(q, k, v, scale):
    """Causal attention of the last T positions of a sequence over all its L keys.

    q (T, n_heads, hd); k, v (L, n_kv, hd). Query j sits at position L - T + j,
    so the causal diagonal is offset by the L - T cached tokens. Computed in fp32.
    """
    T, L = q.shape[0], k.shape[0]
    q, k, v = (x.float().transpose(0, 1) for x in (q, k, v))  # (heads, T or L, hd)
    # Query j sees keys 0 to L - T + j; T = 2, L = 4: [[1, 1, 1, 0], [1, 1, 1, 1]]. torch's
    # is_causal puts the diagonal top-left, right only without a cached prefix.
    pos = torch.arange(L, device=q.device)
    mask = pos <= pos[L - T:, None] if T < L else None  # (T, L)
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                       scale=scale, enable_gqa=True)  # (n_heads, T, hd)
    return o.transpose(0, 1)  # (T, n_heads, hd)


def store_kvcache_ref(k, v, k_cache, v_cache, slot_mapping):
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    for x, cache in ((k, k_cache), (v, v_cache)):       # (num_blocks * block_size, n_kv, hd)
        cache.view(-1, *cache.shape[2:])[slots] = as_stored(x[valid], cache)


def rope_ref(x, positions, cos, sin):
    """x (N_tok, heads, hd) rotated by each token's position, in fp32: the
    "rotate half" layout of transformers, channel i paired with i + hd/2.
    This is the model's own rotation; the CPU path runs it."""
    cos, sin = cos[positions][:, None], sin[positions][:, None]  # (N_tok, 1, hd/2)
    x1, x2 = x.float().chunk(2, dim=-1)  # (N_tok, heads, hd/2) each
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


def rope_store_kvcache_ref(q, k, v, k_cache, v_cache, slot_mapping, positions, cos, sin,
                           q_norm=None, k_norm=None, store=store_kvcache_ref):
    if q_norm is not None:   # Qwen3's RMSNorm modules, weights (hd,): each head normalized first
        q.copy_(rms_norm_ref(q, q_norm.weight, q_norm.eps))
        k = rms_norm_ref(k, k_norm.weight, k_norm.eps)
    q.copy_(rope_ref(q, positions, cos, sin))
    store(rope_ref(k, positions, cos, sin), v, k_cache, v_cache, slot_mapping)


def paged_attention_decode_ref(q, k_cache, v_cache, block_tables, context_lens, scale, out=None):
    out = torch.empty_like(q) if out is None else out
    for b, L in enumerate(context_lens.tolist()):
        if L == 0:  # a padding row (a batch padded to a fixed size)
            out[b] = 0
            continue
        k, v = (_gather_kv_ref(cache, block_tables[b], L) for cache in (k_cache, v_cache))
        out[b] = _attend_ref(q[b:b + 1], k, v, scale)[0]
    return out


def paged_attention_prefill_ref(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens,
                                scale, out=None):
    out = torch.empty_like(q) if out is None else out
    cu = cu_seqlens_q.tolist()
    for b, L in enumerate(context_lens.tolist()):
        if cu[b + 1] == cu[b]:
            continue
        k, v = (_gather_kv_ref(cache, block_tables[b], L) for cache in (k_cache, v_cache))
        out[cu[b]:cu[b + 1]] = _attend_ref(q[cu[b]:cu[b + 1]], k, v, scale)
    return out


def rms_norm_ref(x, weight, eps):
    h = x.float()
    return weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def silu_and_mul_ref(x):
    gate, up = x.float().chunk(2, dim=-1)  # (N_tok, I) each
    return (F.silu(gate) * up).to(x.dtype)


def _prologue_ref(x, norm_weight, eps, silu_mul):
    """f(x) of the fused matmuls: SiLU-and-mul (x = [gate, up]), RMSNorm (with norm_weight) or x."""
    x = silu_and_mul_ref(x) if silu_mul else x
    return x if norm_weight is None else rms_norm_ref(x, norm_weight, eps)


def gemv_ref(x, weight, norm_weight=None, eps=0.0, silu_mul=False, residual=None):
    """residual + f(x) @ weight.T, f being RMSNorm (with norm_weight) or
    SiLU-and-mul (x = [gate, up]) or nothing, with the kernel's rounding: the
    residual added in fp32. (An e4m3 weight's: gemv_fp8_ref.)"""
    y = F.linear(_prologue_ref(x, norm_weight, eps, silu_mul), weight)
    return y if residual is None else (residual.float() + y.float()).to(y.dtype)


def norm(x, weight, eps):                                   # (N_tok, D)
    """RMSNorm (rms_norm_ref): one Triton launch on the GPU, torch ops on the CPU."""
    return rms_norm(x, weight, eps) if x.is_cuda else rms_norm_ref(x, weight, eps)


def linear(x, weight, norm=None, silu_mul=False, residual=None,
           bias=None):                                    # (N_tok, K) -> (N_tok, N)
    """The contract: residual + f(x) @ weight.T + bias, rounded as gemv_ref rounds. f is the
    RMSNorm module `norm` (whose forward is the `norm` function above), SiLU-and-mul
    (x = [gate, up]) or nothing. residual (N_tok, N) and bias (N,) are optional. x, residual and
    the output are in the model's dtype. Every matmul of a layer calls this. Which kernel
    computes it is the second reading's (linear_impl, after the skinny matmul). A bias is a
    residual that every row shares, and takes the residual's path."""
    if bias is not None:
        residual = bias.expand(x.shape[0], -1) if residual is None else residual + bias
    norm_weight, eps = (None, 0.0) if norm is None else (norm.weight, norm.eps)
    return linear_impl(x, weight, norm_weight, eps, silu_mul, residual)


# Each Attention layer's (rope_store, attend) pair comes from ATTENTION, this file's last section.


# -- the sampler's --

def argmax_rows(logits):                                      # (B, V)
    """argmax over the vocabulary, as a two-level reduction: a lone row is too little work for
    one reduction kernel (one block would walk all V entries, ~25 us for Llama-3's vocabulary),
    so each row is cut into 64 chunks reduced side by side first. Ties go to the first index,
    as in torch.argmax."""
    B, V = logits.shape                                    # rows, vocabulary
    if V % 64:
        return logits.argmax(dim=-1)
    best, idx = logits.view(B, 64, V // 64).max(dim=-1)       # (B, 64) each
    chunk = best.argmax(dim=-1, keepdim=True)                 # (B, 1)
    return (chunk * (V // 64) + idx.gather(1, chunk)).squeeze(1)


def apply_token_mask_ref(logits, rows, bitmask):   # (B, V) fp32, (R,) int64, (R, cdiv(V, 32))
    """-inf in place for tokens a row's grammar forbids next: bit j of int32 word i of bitmask
    row r allows token 32 i + j of logit row rows[r]. Returns logits."""
    bits = (bitmask[:, :, None] >> torch.arange(32, device=bitmask.device)) & 1  # (R, V/32, 32)
    allowed = bits.flatten(1)[:, :logits.shape[1]].bool()                       # (R, V)
    logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))
    return logits


def apply_token_mask(logits, rows, bitmask):     # (B, V) fp32, (R,) int64, (R, cdiv(V, 32))
    """-inf, in place, for tokens a row's grammar forbids next (apply_token_mask_ref): one
    Triton launch on the GPU (the interpreter would be slow on the CPU: torch there).
    The host copies V / 8 bytes per constrained row, the bits stay packed."""
    apply = apply_token_mask_triton if logits.is_cuda else apply_token_mask_ref
    return apply(logits, rows, bitmask)


def apply_logit_edits(logits, edits):                        # (B, V) fp32
    """logit_bias and the penalties as sparse edits: a new tensor, changed at N (row, token).
    edits = ((rows, ids), (bias, repetition, penalty)) comes from logit_edits, in nanoserve's
    log-probs chapter. Entry i edits logits[rows[i], ids[i]] in the three steps below."""
    (rows, ids), (bias, repetition, penalty) = edits   # (2, N) int64, (3, N) fp32
    x = logits[rows, ids] + bias                               # logit_bias first, as in vLLM
    x = torch.where(x < 0, x * repetition, x / repetition)     # transformers' repetition rule
    x = x - penalty                            # then OpenAI's presence and frequency penalties
    return logits.index_put((rows, ids), x)


def logit_edit_entries(rows, device):
    """apply_logit_edits' entries, counted on the host with numpy (a Python loop over a long
    prompt's tokens would cost milliseconds per step). For each (row, token_ids, num_prompt_tokens,
    params), an entry per distinct token of logit_bias, of the output, and of the prompt with a
    repetition penalty. So a bias-only row also gets a no-op entry per distinct output token."""
    entries = []                                               # (5, n) per edited row
    for row, token_ids, num_prompt_tokens, p in rows:
        # the tokens the repetition penalty looks at (prompt too), or just the output
        output = token_ids[num_prompt_tokens:]
        seen = token_ids if p.repetition_penalty != 1 else output
        # ids: each distinct token of `seen` and of logit_bias; at[i]: where in
        # ids the i-th of them is (the output is the tail of `seen`)
        ids, at = np.unique([*seen, *p.logit_bias], return_inverse=True)
        times_generated = np.bincount(at[len(seen) - len(output):len(seen)], minlength=len(ids))
        bias = np.bincount(at[len(seen):], list(p.logit_bias.values()), len(ids))
        repetition = np.where(np.isin(ids, seen), p.repetition_penalty, 1.0)
        penalty = (times_generated * p.frequency_penalty
                   + (times_generated > 0) * p.presence_penalty)
        entries.append(np.stack([np.full(len(ids), row), ids, bias, repetition, penalty]))
    e = np.concatenate(entries, axis=1)   # (5, N): row, token, bias, repetition, penalty
    return to_device(device, e[:2], torch.int64), to_device(device, e[2:], torch.float32)


def apply_top_k_top_p(logits, top_ks, top_ps):               # (B, V), (B,), (B,)
    """Set every logit outside a row's top-k and top-p set to -inf. An example row, V = 4, top_k =
    3, top_p = 0.6, probabilities in ascending order [.1, .2, .3, .4]: top-k drops position 0
    (< V - k); the three left renormalize to [.22, .33, .44], whose ascending cumulative mass is
    [.22, .56, 1]; top-p drops each whose mass is <= 1 - p = .4, so .2 goes and [.3, .4] stay."""
    sorted_logits, order = logits.sort(dim=-1)                 # ascending, (B, V)
    V = logits.shape[-1]                                   # vocabulary size
    # top-k by position in the sorted row, so exactly k survive even with ties
    cut = torch.arange(V, device=logits.device) < (V - top_ks).unsqueeze(1)
    sorted_logits.masked_fill_(cut, -float("inf"))
    # top-p: drop a token if it and all smaller ones hold <= 1 - p of the mass; the largest stays
    cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)     # (B, V), ascending mass
    cut = cum <= (1 - top_ps).unsqueeze(1)
    cut[:, -1] = False
    sorted_logits.masked_fill_(cut, -float("inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


# -- the model runner's --

def to_device(device, data, dtype):
    """Host data as a tensor on device, through pinned memory: the copy does not make the host
    wait, and it is queued on the stream behind the work already there."""
    t = torch.as_tensor(np.asarray(data), dtype=dtype)
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t


def put(buffer, values):
    """Host values into the start of a device buffer (a CUDA graph's input), queued the same way."""
    host = torch.as_tensor(np.asarray(values), dtype=buffer.dtype)
    view = buffer[tuple(slice(0, n) for n in host.shape)]    # the buffer's corner of host's shape
    view.copy_(host.pin_memory() if buffer.is_cuda else host, non_blocking=True)


def follow_accepted_ref(tokens, plan, drafts, ids, positions, slot_mapping, context_lens,
                        block_tables, block_size):
    """Move back the rows that were laid out as if the step before kept all its drafts, by the
    drafts it rejected (nanoserve's follow_accepted_drafts). plan (M, 5) int64, a row per such
    sequence: its first sampled row in the step before, its drafts there d, its pending row in
    this step, its rows in this step, its index in this batch. drafts (M, 16): the step before's,
    -1 past d. tokens: the step before's samples. Writes the step's buffers in place."""
    for m, (r0, d, row, width, b) in enumerate(plan.tolist()):
        kept = next((j for j in range(d) if tokens[r0 + j] != drafts[m, j]), d)
        ids[row] = tokens[r0 + kept]                   # sampled after the last kept draft
        context_lens[b] -= d - kept
        pos = positions[row:row + width] - (d - kept)
        positions[row:row + width] = pos
        slot_mapping[row:row + width] = (block_tables[b, pos // block_size].long() * block_size
                                         + pos % block_size)


def follow_accepted(tokens, plan, drafts, ids, positions, slot_mapping, context_lens,
                    block_tables, block_size):
    """follow_accepted_ref in one Triton launch on the GPU (about 20 torch ops otherwise)."""
    args = (tokens, plan, drafts, ids, positions, slot_mapping, context_lens, block_tables)
    if not tokens.is_cuda:
        return follow_accepted_ref(*args, block_size)
    _follow_accepted_kernel[(plan.shape[0],)](*args, block_tables.stride(0), block_size)


def cuda_graph_sizes(max_num_seqs, max_num_batched_tokens):
    """The sizes nanoserve captures a CUDA graph for, ascending, by kind (True: decode, in
    sequences; False: steps with prompt tokens, in tokens). A step replays the next size up,
    so the sizes trade padding against capture time and memory: decode 1, 2, 4, 8, then every
    16; prompt steps every 16 up to 256, then 8 sizes per doubling."""
    S, T, n = max_num_seqs, max_num_batched_tokens, 256
    decode, mixed = {1, 2, 4, 8, *range(16, S + 1, 16), S}, {*range(16, 257, 16), T}
    while n < T:
        n += 2 ** (n.bit_length() - 4)     # an eighth of the last power of two
        mixed.add(n)
    return {True: sorted(n for n in decode if n <= S), False: sorted(n for n in mixed if n <= T)}


def graph_key(graph_sizes, is_decode, num_tokens):
    """Which captured graph replays a step (cuda_graph_sizes' next size up): (is_decode,
    size), or None where none was captured (the step runs eagerly). The largest sizes are the
    step's bounds, so a step never outgrows them."""
    sizes = graph_sizes[is_decode]
    i = bisect.bisect_left(sizes, num_tokens)
    return (is_decode, sizes[i]) if i < len(sizes) else None


# ----------------------------------------------------------------------------
# Shared pieces
# Invariants every kernel relies on, checked once at the boundary, and the
# small torch helpers the references share.

LOG2E = 1.4426950408889634  # exp(x) == exp2(x * LOG2E); exp2 is one GPU instruction


def _is_pow2(n):
    return n > 0 and n & (n - 1) == 0


def _dot_precision(dtype):
    # fp32 inputs would otherwise go through TF32 tensor cores (10-bit mantissa),
    # far from the 1e-5 agreement the fp32 tests ask for; for 16-bit inputs the
    # setting has no effect: the dot is a tensor-core MMA with fp32 accumulation.
    return "ieee" if dtype == torch.float32 else "tf32"


def _check_cache(k_cache, v_cache):
    assert k_cache.dim() == 4, "cache must be (num_blocks, block_size, n_kv, hd)"
    assert k_cache.shape == v_cache.shape and k_cache.dtype == v_cache.dtype
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    assert k_cache.dtype in (torch.float32, torch.bfloat16, torch.float16, FP8)
    block_size, hd = k_cache.shape[1], k_cache.shape[3]
    assert _is_pow2(block_size), f"block_size {block_size} must be a power of two"
    assert _is_pow2(hd) and hd >= 16, f"head dim {hd} must be a power of two >= 16"


def _check_attention_inputs(q, k_cache, v_cache, block_tables, context_lens, out):
    _check_cache(k_cache, v_cache)
    assert q.dim() == 3 and q.shape[2] == k_cache.shape[3], "q must be (rows, n_heads, hd)"
    n_heads, n_kv = q.shape[1], k_cache.shape[2]
    assert k_cache.dtype in (q.dtype, FP8) and q.device == k_cache.device
    assert q.stride(2) == 1, "q rows may be strided views, but each head must be contiguous"
    assert n_heads % n_kv == 0, f"{n_heads} query heads do not group over {n_kv} kv heads"
    assert block_tables.dtype == torch.int32 and block_tables.dim() == 2
    assert block_tables.stride(1) == 1
    assert context_lens.dtype == torch.int32 and context_lens.is_contiguous()
    assert block_tables.shape[0] == context_lens.shape[0]
    if out is not None:
        assert out.shape == q.shape and out.dtype == q.dtype and out.stride(2) == 1


# ----------------------------------------------------------------------------
# store_kvcache
# Each step's new keys and values go into the pool before attention runs, at
# the slots the scheduler chose. slot_mapping[t] = block_id * block_size +
# offset in block, or -1 for a padding token of a CUDA-graph batch.
#
# An fp8 pool holds each K and V value as e4m3 with a scale of 1.0, vLLM's
# default without calibration. A value is clamped to +-FP8_MAX and rounded to
# nearest on store (as_stored, _to_cache). Every reader widens it to q's dtype
# as it loads. A fixed scale needs no calibration and no room in the pool. A
# float's relative precision (3 mantissa bits) is the same at any scale, so a
# per-layer scale would buy only range, which K and V (far below 448) do not
# need.


def as_stored(x, cache):
    """x as the pool holds it: unchanged, or clamped and rounded to e4m3 for an fp8 pool."""
    return x.clamp(-FP8_MAX, FP8_MAX).to(FP8) if cache.dtype == FP8 else x


@triton.jit
def _to_cache(x, cache_ptr):
    """as_stored in a kernel: x in the pool's dtype, clamped first if that is e4m3."""
    if cache_ptr.dtype.element_ty == tl.float8e4nv:
        x = tl.clamp(x.to(tl.float32), -448.0, 448.0)
    return x.to(cache_ptr.dtype.element_ty)


@triton.jit
def _store_kvcache_kernel(
    k_ptr,             # (N_tok, n_kv, hd) new keys, rows may be strided
    v_ptr,             # (N_tok, n_kv, hd) new values, rows may be strided
    k_cache_ptr,       # (num_blocks, block_size, n_kv, hd) contiguous key pool
    v_cache_ptr,       # (num_blocks, block_size, n_kv, hd) contiguous value pool
    slot_mapping_ptr,  # (N_tok,) int64 destination slot of each token, -1 = skip
    n_kv,              # kv heads per token
    stride_kt,         # k stride between tokens
    stride_kh,         # k stride between heads
    stride_vt,         # v stride between tokens
    stride_vh,         # v stride between heads
    N_KV_PAD: tl.constexpr,  # n_kv rounded up to a power of two (tile height)
    HEAD_DIM: tl.constexpr,  # hd
):
    """One program copies the (n_kv, hd) keys and values of one token.

    A slot of the contiguous pool is n_kv * hd elements, so the destination is
    slot * n_kv * hd. Memory traffic: 2 * N_tok * n_kv * hd reads and writes.
    """
    t = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + t)  # int64: slot * n_kv * hd can pass 2**31
    if slot < 0:  # padding token: its slot belongs to nobody
        return
    offs_h = tl.arange(0, N_KV_PAD)
    offs_d = tl.arange(0, HEAD_DIM)
    mask = (offs_h < n_kv)[:, None]
    k = tl.load(k_ptr + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    v = tl.load(v_ptr + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    # (N_KV_PAD, HEAD_DIM) destinations in the pool
    offs_cache = slot * n_kv * HEAD_DIM + offs_h[:, None] * HEAD_DIM + offs_d[None, :]
    tl.store(k_cache_ptr + offs_cache, _to_cache(k, k_cache_ptr), mask=mask)
    tl.store(v_cache_ptr + offs_cache, _to_cache(v, v_cache_ptr), mask=mask)


def store_kvcache(k, v, k_cache, v_cache, slot_mapping):
    _check_cache(k_cache, v_cache)
    N_tok, n_kv, hd = k.shape
    assert v.shape == k.shape and k_cache.shape[2:] == (n_kv, hd)
    assert k.dtype == v.dtype and k_cache.dtype in (k.dtype, FP8)
    assert k.stride(2) == 1 and v.stride(2) == 1, "each head of k and v must be contiguous"
    assert slot_mapping.dtype == torch.int64 and slot_mapping.shape == (N_tok,)
    assert slot_mapping.is_contiguous()
    if N_tok == 0:
        return
    _store_kvcache_kernel[(N_tok,)](
        k, v, k_cache, v_cache, slot_mapping, n_kv,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        N_KV_PAD=triton.next_power_of_2(n_kv), HEAD_DIM=hd,
    )


# ----------------------------------------------------------------------------
# The tile step both attention kernels share
# Find a tile of context tokens in the pool through the block table, then fold
# its scores and values into a running (online) softmax.

@triton.jit
def _paged_kv_offsets(block_tables_ptr, b, stride_bt, offs_tok, mask_n, kv_head, offs_d,
                      stride_cb, stride_ct, stride_ch, BLOCK_SIZE: tl.constexpr):
    """Pool offsets of channels offs_d of the K/V rows of positions offs_tok of
    sequence b; masked positions read no block-table entry (padding entries are
    never read)."""
    block_ids = tl.load(block_tables_ptr + b * stride_bt + offs_tok // BLOCK_SIZE,
                        mask=mask_n, other=0)
    # int64: block_id * stride_cb overflows int32 in pools over 2**31 elements
    rows = block_ids.to(tl.int64) * stride_cb + (offs_tok % BLOCK_SIZE) * stride_ct
    return rows[:, None] + kv_head * stride_ch + offs_d[None, :]  # (BLOCK_N, HEAD_DIM)


@triton.jit
def _online_softmax_step(s, v, m_i, l_i, acc, DOT_PRECISION: tl.constexpr):
    """Fold scores s (rows, BLOCK_N), base 2, and values v (BLOCK_N, hd) into
    the running max m_i, sum l_i and unnormalized output acc: what came
    before is rescaled to the new max."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


# ----------------------------------------------------------------------------
# Programmatic dependent launch, and the last program that finishes the work
# Two mechanisms the decode kernel and the matmuls below share.
#
# Programmatic dependent launch (PDL, Hopper and newer): a kernel launched
# with it may start while the kernel before it is still finishing, and waits
# for that kernel's results (gdc_wait) only where it reads them; until then it
# can load what does not depend on them: weights, tables such as RoPE's cos
# and sin, and the step's inputs (positions, slots), which are copied in
# before the step's first kernel. The kernels of a decode step use it (the
# GEMV, the skinny matmul, RoPE-store and decode), each waiting before its first read of an
# earlier kernel's output and before any early return, so that every
# kernel's completion still implies its predecessors'. At batch 1 a layer is
# a chain of short kernels, and each launch boundary without PDL leaves the
# memory bus idle for a few microseconds. Not in Triton's interpreter.
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"   # Triton's interpreter, on the CPU
USE_PDL = (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9
           and not _INTERPRETED)
PDL_LAUNCH = {"launch_pdl": True} if USE_PDL else {}  # the launch option, where it applies


@triton.jit
def _wait_for_inputs(PDL: tl.constexpr):
    """With PDL: wait until the kernel before has finished and its writes are
    visible, then let the next kernel start its own independent prologue."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


# Split-K arrival counts. When one output needs the work of several programs
# (decode's splits of a context, the matmuls' splits of K), each program writes
# its fp32 partial, then counts itself in with an atomic add on the output's
# counter; the program that arrives last adds up the partials (in split
# order, so the result never depends on timing), writes the output and sets
# the counter back to 0. So every launch leaves the counters at 0, one zeroed
# buffer serves every launch of both kernels, and no second kernel merges
# the partials. Two launches never use the counters at once: each touches
# them only after its PDL wait, once the launch before has finished.
SPLIT_K_NUM_COUNTERS = 1 << 16  # outputs with a counter in one launch


@functools.lru_cache(maxsize=None)
def _split_k_counts(device):
    """The counters, zeroed once per device (see above)."""
    assert not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()), \
        "call the kernel once outside CUDA-graph capture first: a captured zeroing never runs"
    return torch.zeros(SPLIT_K_NUM_COUNTERS, dtype=torch.int32, device=device)


# ----------------------------------------------------------------------------
# Decode: flash-decoding over the paged cache
# One query token per sequence: too little work per sequence to fill a GPU,
# so each sequence's context is split into chunks handled by separate
# programs, and the last of them to finish merges their partial softmax
# results (see the arrival counts above).

# Chosen by a sweep on an H200 (bf16, Llama-3.2-1B heads, batch 1-256 x
# context 1k-8k): 128-token tiles with 3 in flight, and splits only until the
# grid holds two programs per SM.
DECODE_BLOCK_N = 128    # context tokens per KV tile
DECODE_MAX_SPLITS = 64  # cap on programs per (sequence, kv head)
DECODE_PROGRAMS_PER_SM = 2
DECODE_NUM_WARPS = 4
DECODE_NUM_STAGES = 3   # KV tiles in flight (software pipelining of the loop)


@triton.jit
def _merge_splits(part_out_ptr, part_lse_ptr, offs_part, mask_g, offs_d, num_active,
                  G_PAD: tl.constexpr, HEAD_DIM: tl.constexpr):
    """The exact softmax over the whole context from the num_active splits'
    partials of G_PAD query heads: split i saw a softmax over its own tokens
    with total mass 2**lse_i, so the result is sum_i w_i out_i / sum_i w_i,
    w_i = 2**lse_i, rescaled to the running max as in the online softmax.
    ".cg" loads: the other programs' partials are read from L2, never from a
    stale L1."""
    m = tl.full([G_PAD], float("-inf"), tl.float32)
    w_sum = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, HEAD_DIM], tl.float32)
    for s in range(0, num_active):
        lse = tl.load(part_lse_ptr + offs_part + s, mask=mask_g, other=0.0, cache_modifier=".cg")
        o = tl.load(part_out_ptr + (offs_part + s)[:, None] * HEAD_DIM + offs_d[None, :],
                    mask=mask_g[:, None], other=0.0, cache_modifier=".cg")  # (G_PAD, HEAD_DIM)
        m_new = tl.maximum(m, lse)
        alpha = tl.exp2(m - m_new)
        w = tl.exp2(lse - m_new)
        w_sum = w_sum * alpha + w
        acc = acc * alpha[:, None] + w[:, None] * o
        m = m_new
    return acc / w_sum[:, None]


@triton.jit
def _e4m3_to_f16(x):
    """e4m3 to fp16, 4 values a PTX call. Not pure, so it runs where it stands: with .to(), Triton
    moves V's tile into the dot's layout while it is still 8-bit, one byte load per value (sm_90
    has no transposed 8-bit ldmatrix); widened first, it takes fp16's: 263 -> 186 us on an H200
    at 8B's shapes, 256 sequences of 1,024 tokens. Triton's interpreter runs no PTX."""
    return tl.inline_asm_elementwise(
        "{ .reg .b16 a<2>; mov.b32 {a0, a1}, $2; cvt.rn.f16x2.e4m3x2 $0, a0; "
        "cvt.rn.f16x2.e4m3x2 $1, a1; }", "=r,=r,r", [x.to(tl.uint8, bitcast=True)],
        dtype=tl.float16, is_pure=False, pack=4)


@triton.jit
def _decode_kernel(
    q_ptr,              # (B, n_heads, hd) one query per sequence
    k_cache_ptr,        # (num_blocks, block_size, n_kv, hd) key pool
    v_cache_ptr,        # (num_blocks, block_size, n_kv, hd) value pool
    block_tables_ptr,   # (B, max_blocks) int32 block ids of each sequence
    context_lens_ptr,   # (B,) int32 tokens in the cache, the new one included
    part_out_ptr,       # (B, n_heads, NUM_SPLITS, hd) fp32 output of each split, normalized
    part_lse_ptr,       # (B, n_heads, NUM_SPLITS) fp32 base-2 log-sum-exp of each split
    counts_ptr,         # (B * n_kv,) int32 splits finished per (sequence, kv head), 0 between launches
    out_ptr,            # (B, n_heads, hd) the result
    qk_scale,           # softmax scale * LOG2E, so the softmax runs in base 2
    num_heads,          # n_heads
    stride_qb,          # q stride between sequences
    stride_qh,          # q stride between heads
    stride_ob,          # out stride between sequences
    stride_oh,          # out stride between heads
    stride_bt,          # block_tables stride between sequences
    stride_cb,          # cache stride between blocks
    stride_ct,          # cache stride between tokens of a block
    stride_ch,          # cache stride between kv heads
    G: tl.constexpr,           # query heads per kv head
    G_PAD: tl.constexpr,       # G rounded up to a power of two >= 16 (rows of the tl.dot)
    HEAD_DIM: tl.constexpr,    # hd
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block
    BLOCK_N: tl.constexpr,     # tokens per KV tile
    NUM_SPLITS: tl.constexpr,  # programs per (sequence, kv head): the most splits (power of two)
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 inputs, else the tensor-core default
    PDL: tl.constexpr,         # launched with programmatic dependent launch (USE_PDL)
    E4M3_PTX: tl.constexpr,    # bf16 q, fp8 pool, GPU: K, V and q in fp16 (_e4m3_to_f16)
):
    """Program (kv head, b, split) attends the G query heads of one kv head to
    one contiguous chunk of sequence b's context.

    Online softmax over KV tiles: keep a running max m, running sum l and
    unnormalized output acc per query head; for each tile of BLOCK_N tokens
    (each located in the pool through the block table),
        s = q k^T * scale;  m' = max(m, rowmax s);  p = exp(s - m')
        l = l * exp(m - m') + rowsum p;  acc = acc * exp(m - m') + p v
    and finally acc / l is the split's output and m + log l its log-sum-exp.

    Splits: sequence b's tiles are cut into runs of cdiv(tiles, NUM_SPLITS),
    one per split; the splits past the last run hold nothing and return at
    once. The grid depends on no host-side length (so it is graph-safe), yet
    a short context costs what it needs: one active split writes its output
    directly, and several store their partials, of which the last to finish
    computes the merge (_merge_splits). No second kernel.

    GQA: the G query heads sharing a kv head form the rows of one (G_PAD, hd)
    tile, so each K/V tile is read once per group and both products are
    tensor-core tl.dots; a lone query row would leave the tensor cores idle
    and force a slower elementwise reduction, and the padding rows are free
    because decode is bound by memory, not math.

    Memory traffic: every K/V element of the context is read exactly once,
    2 * L * n_kv * hd elements per sequence; the partials add only
    2 * num_active * n_heads * hd fp32 per sequence.
    """
    tl.static_assert(G_PAD >= G, "a group's query heads must fit in the tile")
    tl.static_assert(G_PAD >= 16, "tl.dot needs at least 16 rows")
    tl.static_assert(BLOCK_N >= 16 and HEAD_DIM >= 16, "tl.dot needs inner/outer dims >= 16")
    # kv heads vary fastest over the grid: programs that run side by side read
    # the same blocks (a token's n_kv heads are adjacent in the pool).
    kv_head, b, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    _wait_for_inputs(PDL)  # q comes from the kernel before
    L = tl.load(context_lens_ptr + b)
    # -- this split's run of tiles; 1 active split for an empty (padding) row --
    num_tiles = tl.cdiv(L, BLOCK_N)
    tiles_per_split = tl.maximum(tl.cdiv(num_tiles, NUM_SPLITS), 1)
    num_active = tl.maximum(tl.cdiv(num_tiles, tiles_per_split), 1)
    if split >= num_active:  # past the end of a short context: nothing to read
        return
    tile_lo = split * tiles_per_split
    tile_hi = tl.minimum(tile_lo + tiles_per_split, num_tiles)

    offs_g = tl.arange(0, G_PAD)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = tl.arange(0, BLOCK_N)
    heads = kv_head * G + offs_g  # (G_PAD,) query heads of this group
    mask_g = offs_g < G
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=mask_g[:, None], other=0.0)  # (G_PAD, HEAD_DIM)
    if E4M3_PTX:            # e4m3 widens to fp16 exactly, in one instruction (bf16 takes two)
        q = q.to(tl.float16)

    m_i = tl.full([G_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, HEAD_DIM], tl.float32)
    for tile in range(tile_lo, tile_hi):
        # -- find the tile's tokens in the pool --
        offs_tok = tile * BLOCK_N + offs_n  # (BLOCK_N,) positions in the sequence
        mask_n = offs_tok < L
        offs_kv = _paged_kv_offsets(block_tables_ptr, b, stride_bt, offs_tok, mask_n, kv_head,
                                    offs_d, stride_cb, stride_ct, stride_ch, BLOCK_SIZE)
        # -- scores (K and V in q's dtype: an fp8 pool's e4m3 widened as it loads) --
        k = tl.load(k_cache_ptr + offs_kv, mask=mask_n[:, None], other=0.0).to(q.dtype)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # (G_PAD, BLOCK_N)
        s = tl.where(mask_n[None, :], s, float("-inf"))  # every tile holds >= 1 real token
        # -- online softmax, accumulate p v --
        v = tl.load(v_cache_ptr + offs_kv, mask=mask_n[:, None], other=0.0)
        v = _e4m3_to_f16(v) if E4M3_PTX else v.to(q.dtype)
        m_i, l_i, acc = _online_softmax_step(s, v, m_i, l_i, acc, DOT_PRECISION)

    # An empty row (L == 0) leaves l_i == 0 and acc == 0: its output is 0.
    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # (G_PAD, HEAD_DIM)
    offs_out = b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :]
    if NUM_SPLITS > 1 and num_active > 1:
        # -- several splits: store the partial; the last to arrive merges --
        offs_part = (b * num_heads + heads) * NUM_SPLITS  # (G_PAD,) first partial of each head
        tl.store(part_lse_ptr + offs_part + split, m_i + tl.log2(l_i), mask=mask_g)
        tl.store(part_out_ptr + (offs_part + split)[:, None] * HEAD_DIM + offs_d[None, :], o,
                 mask=mask_g[:, None])
        tl.debug_barrier()  # all of this program's partial is written before it counts in
        count_ptr = counts_ptr + b * tl.num_programs(0) + kv_head
        if tl.atomic_add(count_ptr, 1, sem="acq_rel") < num_active - 1:
            return
        tl.atomic_xchg(count_ptr, 0)
        o = _merge_splits(part_out_ptr, part_lse_ptr, offs_part, mask_g, offs_d, num_active,
                          G_PAD, HEAD_DIM)
    tl.store(out_ptr + offs_out, o.to(out_ptr.dtype.element_ty), mask=mask_g[:, None])


@functools.lru_cache(maxsize=None)
def _num_sms(device):
    if device.type != "cuda":
        return 8  # the interpreter: few programs, still enough to exercise splitting
    return torch.cuda.get_device_properties(device).multi_processor_count


def _decode_num_splits(B, n_kv, max_tiles, device):
    """Splits per sequence, from static shapes only (no host sync, graph-safe).

    Aim for two programs per SM, but never more splits than the widest context
    the block table can hold has tiles (the kernel's docstring says how a short
    context uses fewer). A power of two, to bound the compiled variants.
    """
    want = triton.cdiv(DECODE_PROGRAMS_PER_SM * _num_sms(device), B * n_kv)
    return min(triton.next_power_of_2(want), triton.next_power_of_2(max_tiles), DECODE_MAX_SPLITS)


def paged_attention_decode(q, k_cache, v_cache, block_tables, context_lens, scale, out=None):
    """paged_attention_decode_ref in one launch. No host sync."""
    _check_attention_inputs(q, k_cache, v_cache, block_tables, context_lens, out)
    B, n_heads, hd = q.shape
    block_size, n_kv = k_cache.shape[1], k_cache.shape[2]
    assert B == context_lens.shape[0]
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device) if out is None else out
    if B == 0:
        return out
    assert B * n_kv <= SPLIT_K_NUM_COUNTERS
    G = n_heads // n_kv
    max_tiles = triton.cdiv(block_tables.shape[1] * block_size, DECODE_BLOCK_N)
    num_splits = _decode_num_splits(B, n_kv, max_tiles, q.device)
    part_out = torch.empty(B, n_heads, num_splits, hd, dtype=torch.float32, device=q.device)
    part_lse = torch.empty(B, n_heads, num_splits, dtype=torch.float32, device=q.device)
    _decode_kernel[(n_kv, B, num_splits)](
        q, k_cache, v_cache, block_tables, context_lens, part_out, part_lse,
        _split_k_counts(q.device), out, scale * LOG2E, n_heads,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        G=G, G_PAD=max(16, triton.next_power_of_2(G)), HEAD_DIM=hd, BLOCK_SIZE=block_size,
        BLOCK_N=DECODE_BLOCK_N, NUM_SPLITS=num_splits, DOT_PRECISION=_dot_precision(q.dtype),
        PDL=USE_PDL,
        E4M3_PTX=k_cache.dtype == FP8 and q.dtype == torch.bfloat16 and not _INTERPRETED,
        num_warps=DECODE_NUM_WARPS, num_stages=DECODE_NUM_STAGES, **PDL_LAUNCH,
    )
    return out


# ----------------------------------------------------------------------------
# Following accepted drafts: a program per moved sequence (follow_accepted_ref)

@triton.jit
def _follow_accepted_kernel(tokens_ptr, plan_ptr, drafts_ptr, ids_ptr, pos_ptr, slot_ptr,
                            lens_ptr, tables_ptr, stride_bt, BLOCK_SIZE: tl.constexpr):
    m = tl.program_id(0)
    r0, d = tl.load(plan_ptr + m * 5), tl.load(plan_ptr + m * 5 + 1)
    row, width = tl.load(plan_ptr + m * 5 + 2), tl.load(plan_ptr + m * 5 + 3)
    b = tl.load(plan_ptr + m * 5 + 4)
    offs = tl.arange(0, 16)                           # a row's drafts and its rows: at most 16
    sampled = tl.load(tokens_ptr + r0 + offs, mask=offs < d, other=-1)
    draft = tl.load(drafts_ptr + m * 16 + offs, mask=offs < d, other=-1)
    kept = tl.min(tl.where((sampled != draft) | (offs >= d), offs, 16))   # d if all agree
    shift = d - kept
    tl.store(ids_ptr + row, tl.load(tokens_ptr + r0 + kept))
    tl.store(lens_ptr + b, tl.load(lens_ptr + b) - shift.to(tl.int32))
    mask = offs < width
    pos = tl.load(pos_ptr + row + offs, mask=mask, other=0) - shift
    tl.store(pos_ptr + row + offs, pos, mask=mask)
    block = tl.load(tables_ptr + b * stride_bt + pos // BLOCK_SIZE, mask=mask, other=0)
    tl.store(slot_ptr + row + offs, block.to(tl.int64) * BLOCK_SIZE + pos % BLOCK_SIZE, mask=mask)


# ----------------------------------------------------------------------------
# Prefill: varlen causal flash-attention over the paged cache
# The new tokens of many sequences arrive flattened in one (N_tok, ...) batch,
# sequence b owning rows cu_seqlens_q[b]:cu_seqlens_q[b+1]. Each may follow a
# cached prefix (chunked prefill) or be a single decode token. The grid is
# sized from N_tok and B alone, never from the sequences' lengths, so a CUDA
# graph captured for N_tok tokens and B sequences replays any batch that fits.

PREFILL_BLOCK_M = 64   # rows (query token, head of the group) per program
PREFILL_BLOCK_N = 64   # context tokens per KV tile
PREFILL_NUM_WARPS = 4
PREFILL_NUM_STAGES = 3


@triton.jit
def _first_tile(cu_seqlens_q_ptr, b, G: tl.constexpr, BLOCK_M: tl.constexpr):
    """The first program of sequence b: floor(cu[b] * G / BLOCK_M) + b. Sequence
    b then has floor(cu[b+1] G / BLOCK_M) - floor(cu[b] G / BLOCK_M) + 1 >=
    cdiv(T_b G, BLOCK_M) programs, all its tiles, and the whole batch fits in
    N_tok * G // BLOCK_M + B programs."""
    return tl.load(cu_seqlens_q_ptr + b) * G // BLOCK_M + b


@triton.jit(do_not_specialize=["num_seqs"])
def _prefill_kernel(
    q_ptr,              # (N_tok, n_heads, hd) new queries of all sequences, rows may be strided
    k_cache_ptr,        # (num_blocks, block_size, n_kv, hd) key pool, new keys already stored
    v_cache_ptr,        # (num_blocks, block_size, n_kv, hd) value pool, new values already stored
    out_ptr,            # (N_tok, n_heads, hd) result
    block_tables_ptr,   # (B, max_blocks) int32 block ids of each sequence
    cu_seqlens_q_ptr,   # (B + 1,) int32 first row of each sequence in q
    context_lens_ptr,   # (B,) int32 tokens in the cache per sequence, new ones included
    num_seqs,           # B
    qk_scale,           # softmax scale * LOG2E, so the softmax runs in base 2
    stride_qt,          # q stride between tokens
    stride_qh,          # q stride between heads
    stride_ot,          # out stride between tokens
    stride_oh,          # out stride between heads
    stride_bt,          # block_tables stride between sequences
    stride_cb,          # cache stride between blocks
    stride_ct,          # cache stride between tokens of a block
    stride_ch,          # cache stride between kv heads
    G: tl.constexpr,           # query heads per kv head
    HEAD_DIM: tl.constexpr,    # hd
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block
    BLOCK_M: tl.constexpr,     # packed query rows per program
    BLOCK_N: tl.constexpr,     # tokens per KV tile
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 inputs, else the tensor-core default
):
    """Program (p, kv head) computes one tile of BLOCK_M query rows of one
    sequence, which it finds by binary search: p lies in [_first_tile(b),
    _first_tile(b + 1)). Programs past a sequence's last tile, or in a
    sequence with no rows (padding of a CUDA-graph batch), return at once.

    GQA packing: the T new tokens times the G heads of one kv head form T * G
    rows, row r being token r // G, head r % G; a program takes BLOCK_M
    consecutive rows, so every K/V tile it loads serves G heads at once and no
    row is wasted when G is not a power of two.

    Causality: token j of sequence b sits at position L - T + j. Keys below the
    tile's first position are seen by every row, so those tiles need no mask;
    the tiles up to the tile's last position are masked per row, and tiles
    past it are never loaded. Online softmax as in the decode kernel, in one
    pass since a tile already has BLOCK_M rows.

    Memory traffic: Q and out once; each K/V element once per query tile that
    reaches it, about (T * G / BLOCK_M) * L * n_kv * hd * 2 reads per sequence.
    """
    tl.static_assert(BLOCK_M >= 16, "tl.dot needs at least 16 rows")
    tl.static_assert(BLOCK_N >= 16 and HEAD_DIM >= 16, "tl.dot needs inner/outer dims >= 16")
    pid, kv_head = tl.program_id(0), tl.program_id(1)
    # -- a padding sequence (no rows: cu[b] == cu[B]) owns one program, _first_tile(b), which
    # leaves before the search: a graph has up to max_num_seqs sequence slots, mostly padding,
    # and a search in each made a small mixed step's attention slower (README, Speed) --
    total = tl.load(cu_seqlens_q_ptr + num_seqs)
    pad = pid - total * G // BLOCK_M   # the padding sequence this program would be
    if tl.load(cu_seqlens_q_ptr + pad, mask=(pad >= 0) & (pad < num_seqs), other=-1) == total:
        return
    # -- find this program's sequence: the last b with _first_tile(b) <= pid --
    b, hi = 0, num_seqs - 1
    while b < hi:
        mid = (b + hi + 1) // 2
        if _first_tile(cu_seqlens_q_ptr, mid, G, BLOCK_M) <= pid:
            b = mid
        else:
            hi = mid - 1
    tile = pid - _first_tile(cu_seqlens_q_ptr, b, G, BLOCK_M)
    q_start = tl.load(cu_seqlens_q_ptr + b)
    T = tl.load(cu_seqlens_q_ptr + b + 1) - q_start
    if tile * BLOCK_M >= T * G:  # the grid is sized for the worst case
        return
    L = tl.load(context_lens_ptr + b)

    offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)  # (BLOCK_M,) packed rows
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = tl.arange(0, BLOCK_N)
    mask_m = offs_m < T * G
    tok = offs_m // G  # (BLOCK_M,) query token within the sequence
    heads = kv_head * G + offs_m % G  # (BLOCK_M,) query head
    q_pos = L - T + tok  # (BLOCK_M,) position of each row's token in the sequence
    offs_q = (q_start + tok) * stride_qt + heads * stride_qh  # (BLOCK_M,)
    q = tl.load(q_ptr + offs_q[:, None] + offs_d[None, :], mask=mask_m[:, None], other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)

    # Keys [0, kv_full) are visible to every row of the tile; keys up to kv_hi
    # to some; none past it.
    first_pos = L - T + (tile * BLOCK_M) // G
    kv_full = (first_pos + 1) // BLOCK_N * BLOCK_N
    kv_hi = L - T + tl.minimum((tile * BLOCK_M + BLOCK_M - 1) // G, T - 1) + 1
    for start_n in range(0, kv_hi, BLOCK_N):
        # -- find the tile's tokens in the pool --
        offs_tok = start_n + offs_n  # (BLOCK_N,) key positions
        mask_n = offs_tok < kv_hi
        offs_kv = _paged_kv_offsets(block_tables_ptr, b, stride_bt, offs_tok, mask_n, kv_head,
                                    offs_d, stride_cb, stride_ct, stride_ch, BLOCK_SIZE)
        # -- scores, causally masked only where the tile reaches the diagonal --
        k = tl.load(k_cache_ptr + offs_kv, mask=mask_n[:, None], other=0.0).to(q.dtype)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # (BLOCK_M, BLOCK_N)
        if start_n >= kv_full:
            # Key 0 is visible to every row (q_pos >= 0), so m_i is finite
            # after the first tile and fully masked rows stay NaN-free.
            visible = (offs_tok[None, :] <= q_pos[:, None]) & mask_n[None, :]
            s = tl.where(visible, s, float("-inf"))
        # -- online softmax, accumulate p v --
        v = tl.load(v_cache_ptr + offs_kv, mask=mask_n[:, None], other=0.0).to(q.dtype)
        m_i, l_i, acc = _online_softmax_step(s, v, m_i, l_i, acc, DOT_PRECISION)

    offs_out = (q_start + tok) * stride_ot + heads * stride_oh  # (BLOCK_M,)
    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + offs_out[:, None] + offs_d[None, :], o.to(out_ptr.dtype.element_ty),
             mask=mask_m[:, None])


def paged_attention_prefill(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens,
                            scale, out=None):
    """Rows of q past cu_seqlens_q[-1] (padding) are left unwritten. No host sync."""
    _check_attention_inputs(q, k_cache, v_cache, block_tables, context_lens, out)
    N_tok, n_heads, hd = q.shape
    block_size, n_kv = k_cache.shape[1], k_cache.shape[2]
    B = context_lens.shape[0]
    assert cu_seqlens_q.dtype == torch.int32 and cu_seqlens_q.shape == (B + 1,)
    assert cu_seqlens_q.is_contiguous()
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device) if out is None else out
    if N_tok == 0 or B == 0:
        return out
    G = n_heads // n_kv
    grid = (N_tok * G // PREFILL_BLOCK_M + B, n_kv)
    _prefill_kernel[grid](
        q, k_cache, v_cache, out, block_tables, cu_seqlens_q, context_lens, B,
        scale * LOG2E, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        block_tables.stride(0), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        G=G, HEAD_DIM=hd, BLOCK_SIZE=block_size, BLOCK_M=PREFILL_BLOCK_M,
        BLOCK_N=PREFILL_BLOCK_N, DOT_PRECISION=_dot_precision(q.dtype),
        num_warps=PREFILL_NUM_WARPS, num_stages=PREFILL_NUM_STAGES,
    )
    return out


# ----------------------------------------------------------------------------
# RMSNorm and SiLU-and-mul for steps of many tokens
# Where neither matmul below applies them on the fly (past 16 rows, and the
# shapes that cuBLAS takes) these elementwise steps run on their own: one
# program per token row, one read and one write, one launch. An eager step
# issues about two hundred launches, so what each costs the host counts as
# much as what it costs the device.


@triton.jit
def _rms_norm_kernel(
    x_ptr,      # (N_tok, D) input rows, rows may be strided
    w_ptr,      # (D,) the norm's weight
    out_ptr,    # (N_tok, D) result, contiguous
    stride_x,   # x stride between rows
    D,          # features per row
    eps,        # added to the mean square
    BLOCK_D: tl.constexpr,  # D rounded up to a power of two
):
    """One program normalizes one row: x / rms(x) in fp32, rounded to x's
    dtype before the weight multiplies, as transformers rounds.
    Memory traffic: N_tok * D read and written."""
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK_D)
    mask = offs < D
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    h = (x * tl.rsqrt(tl.sum(x * x, 0) / D + eps)).to(out_ptr.dtype.element_ty)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0)
    tl.store(out_ptr + row * D + offs, (w.to(tl.float32) * h.to(tl.float32)).to(h.dtype), mask=mask)


def rms_norm(x, weight, eps):
    """rms_norm_ref in one launch. No host sync."""
    N_tok, D = x.shape
    assert weight.shape == (D,) and weight.is_contiguous() and x.stride(1) == 1
    assert x.dtype == weight.dtype
    out = torch.empty(N_tok, D, dtype=x.dtype, device=x.device)
    if N_tok:
        _rms_norm_kernel[(N_tok,)](x, weight, out, x.stride(0), D, eps,
                                   BLOCK_D=triton.next_power_of_2(D), num_warps=8)
    return out


@triton.jit
def _silu_and_mul_kernel(
    x_ptr,     # (N_tok, 2 I) gate then up, contiguous
    out_ptr,   # (N_tok, I) result
    I,         # features of the result
    BLOCK: tl.constexpr,  # features per program
):
    """Program (row, block) computes silu(gate) * up for BLOCK features of one
    row, in fp32, rounded once. Memory traffic: N_tok * 3 I."""
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < I
    gate = tl.load(x_ptr + row * 2 * I + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * 2 * I + I + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * I + offs, (gate * tl.sigmoid(gate) * up).to(out_ptr.dtype.element_ty),
             mask=mask)


def silu_and_mul(x):
    """silu_and_mul_ref in one launch. No host sync."""
    N_tok, I = x.shape[0], x.shape[1] // 2
    assert x.is_contiguous() and x.shape[1] == 2 * I
    out = torch.empty(N_tok, I, dtype=x.dtype, device=x.device)
    if N_tok:
        _silu_and_mul_kernel[(N_tok, triton.cdiv(I, 1024))](x, out, I, BLOCK=1024, num_warps=4)
    return out


# ----------------------------------------------------------------------------
# GEMV for batch-1 decode
# With a few rows, y = x W^T is one read of the weight W and almost no math, so
# its time is the weight's bytes over the memory bandwidth, and whatever else
# the layer does to x (RMSNorm, SiLU-and-mul, the residual add) costs a launch
# and a wait of its own. This kernel reads W once and does those elementwise
# steps on its way in (prologue) and out (epilogue).

# Rows up to which the engine takes this kernel. Each further row re-reads W
# (from L2 at best), and on an H200 two rows already lose to cuBLAS with
# separate elementwise kernels, so it serves batch-1 decode. At one row it
# is faster than the skinny matmul below (no tensor cores, no shared memory),
# except on the largest weights (_skinny_config).
GEMV_MAX_ROWS = 1


@triton.jit
def _gemv_kernel(
    x_ptr,       # (M, K) input rows; (M, 2 K), gate then up, when SILU_MUL
    w_ptr,       # (N, K) weight, rows contiguous as nn.Linear stores it (or e4m3: SCALE)
    out_ptr,     # (M, N) result
    norm_w_ptr,  # (K,) RMSNorm weight, read only when NORM
    res_ptr,     # (M, N) residual added to the result, read only when RESIDUAL
    scale_ptr,   # (N,) fp32 scale of each e4m3 weight row, read only when SCALE
    part_ptr,    # (M, SPLIT_K, N) fp32 partial sums of the K splits (scratch)
    counts_ptr,  # (M * cdiv(N, BLOCK_N),) int32 splits finished per tile, 0 between launches
    N,           # output features
    K,           # input features
    eps,         # RMSNorm epsilon
    stride_xm,   # x stride between rows
    stride_wn,   # w stride between rows
    stride_om,   # out stride between rows
    stride_rm,   # residual stride between rows
    BLOCK_N: tl.constexpr,   # output features per program
    BLOCK_K: tl.constexpr,   # input features per loop step
    SPLIT_K: tl.constexpr,   # programs sharing one tile's K
    NORM: tl.constexpr,      # x -> norm_w * RMSNorm(x)
    NORM_BLOCK: tl.constexpr,  # columns of x per step of the norm's first pass
    SILU_MUL: tl.constexpr,  # x -> silu(gate) * up
    RESIDUAL: tl.constexpr,  # out = residual + x W^T
    SCALE: tl.constexpr,     # fp8 weights: out = (x W^T) * scale, per output feature
    PDL: tl.constexpr,       # launched with programmatic dependent launch (USE_PDL)
):
    """Program (m, tile, split) computes out[m, tile * BLOCK_N : (tile + 1) * BLOCK_N]
    over the split-th of SPLIT_K equal runs of K.

    Each program streams its BLOCK_N rows of W, BLOCK_K columns at a time,
    multiplying them elementwise by the matching slice of x into a
    (BLOCK_N, BLOCK_K) fp32 accumulator that is summed over K only once, at
    the end (plain FMAs in the loop, no shuffles). No tensor cores: padding one
    row to a 16-row tile would multiply the prologue's work by 16, and every
    program repeats that work for its slice of x (cheap next to its weights).

    Split-K: a matrix with few output tiles (N / BLOCK_N programs, ~1 per SM)
    cannot keep enough loads in flight to fill the memory bus, so SPLIT_K
    programs share each tile; the last of them to finish adds up their fp32
    partials and applies the epilogue (the arrival counts, above decode).
    One launch, no second pass.

    Rounding follows the unfused layers: RMSNorm computes x / rms in fp32,
    rounds to x's dtype, then multiplies by its weight in that dtype;
    SiLU-and-mul computes in fp32 and rounds once; the residual is added to
    the rounded product. Memory traffic: N * K weights (bytes: 2 in bf16, 1 in
    fp8), plus M * (K + N) and the partials, 2 * M * SPLIT_K * N fp32.
    """
    tl.static_assert(not (NORM and SILU_MUL), "one prologue at a time")
    m, tile, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    x_row = x_ptr + m * stride_xm
    dtype = out_ptr.dtype.element_ty  # of x and out; the weight's too unless fp8

    # This split's run of K, and its first weight tile, requested at once so
    # that its latency overlaps the norm's first pass. Then prefetching: each
    # step asks for the next tile before it computes on the current one, two
    # tiles in flight per program (Triton pipelines only tl.dot operands).
    k_per_split = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K) * BLOCK_K
    k_lo = split * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    offs_k = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :]  # (BLOCK_N, BLOCK_K) at column 0
    w = tl.load(w_ptrs + k_lo, mask=mask_n[:, None] & (offs_k + k_lo < k_hi)[None, :], other=0.0)
    # The weights depend on no earlier kernel: with PDL their first tile is
    # on its way while that kernel finishes; x, the residual and the split-K
    # counts are read only after the wait.
    _wait_for_inputs(PDL)

    if NORM:  # -- first pass: 1 / rms of the whole row, whatever the split --
        # NORM_BLOCK columns a step, the whole row at once for K <= 4096: each
        # step is a round trip to L2 that every program waits for.
        offs_r = tl.arange(0, NORM_BLOCK)
        sum_sq = tl.zeros([NORM_BLOCK], tl.float32)
        for k0 in range(0, K, NORM_BLOCK):
            xk = tl.load(x_row + k0 + offs_r, mask=k0 + offs_r < K, other=0.0).to(tl.float32)
            sum_sq += xk * xk
        rstd = tl.rsqrt(tl.sum(sum_sq, 0) / K + eps)

    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        # -- the next weight tile is requested before this one is used --
        mask_next = mask_n[:, None] & (offs_k + k0 + BLOCK_K < k_hi)[None, :]
        w_next = tl.load(w_ptrs + (k0 + BLOCK_K), mask=mask_next, other=0.0)  # (BLOCK_N, BLOCK_K)
        # -- this step's slice of x, through the prologue --
        offs_xk = k0 + offs_k
        mask_k = offs_xk < k_hi
        if SILU_MUL:
            gate = tl.load(x_row + offs_xk, mask=mask_k, other=0.0).to(tl.float32)
            up = tl.load(x_row + K + offs_xk, mask=mask_k, other=0.0).to(tl.float32)
            a = (gate * tl.sigmoid(gate) * up).to(dtype)
        else:
            a = tl.load(x_row + offs_xk, mask=mask_k, other=0.0)
        if NORM:
            h = (a.to(tl.float32) * rstd).to(dtype)
            a = tl.load(norm_w_ptr + offs_xk, mask=mask_k, other=0.0) * h
        acc += w.to(tl.float32) * a.to(tl.float32)[None, :]
        w = w_next
    y = tl.sum(acc, 1)  # (BLOCK_N,) fp32

    if SPLIT_K > 1:  # -- the last split of the tile to finish adds up all of them --
        tl.store(part_ptr + (m * SPLIT_K + split) * N + offs_n, y, mask=mask_n)
        tl.debug_barrier()  # all of this program's partial is written before it counts in
        count_ptr = counts_ptr + m * tl.num_programs(1) + tile
        if tl.atomic_add(count_ptr, 1, sem="acq_rel") < SPLIT_K - 1:
            return
        tl.atomic_xchg(count_ptr, 0)
        y = tl.zeros([BLOCK_N], tl.float32)
        for s in range(SPLIT_K):  # ".cg": read the other SMs' partials from L2, not a stale L1
            y += tl.load(part_ptr + (m * SPLIT_K + s) * N + offs_n, mask=mask_n, cache_modifier=".cg")

    if SCALE:  # fp8 weights: the row's scale, once per output rather than per weight
        y *= tl.load(scale_ptr + offs_n, mask=mask_n, other=0.0)
    y = y.to(dtype)
    if RESIDUAL:
        r = tl.load(res_ptr + m * stride_rm + offs_n, mask=mask_n)
        y = (r.to(tl.float32) + y.to(tl.float32)).to(dtype)
    tl.store(out_ptr + m * stride_om + offs_n, y, mask=mask_n)


# (N, K) -> (BLOCK_N, BLOCK_K, SPLIT_K, num_warps), from a sweep on an H200
# with PDL (bf16, one row, Llama-3.2-1B shapes, each with its own prologue and
# epilogue): every candidate timed inside a whole batch-1 decode step (16
# layers and the LM head in a CUDA graph), since a small GEMV's cost is also
# how it overlaps its neighbours (the per-matrix times: README, Speed). The
# small matrices are bound by latency, not bandwidth: 8 to 13 MB are gone in a
# few round trips.
def _gemv_config(N, K):
    if N > 65536:       # the LM head
        return 16, 128, 1, 4
    if K > 4096:        # down: 2048 outputs are too few tiles to fill the GPU alone
        return 16, 128, 8, 4
    if N > 8192:        # gate_up
        return 32, 128, 1, 4
    if N > K:           # qkv
        return 8, 512, 1, 4
    return 8, 1024, 1, 8  # o


# The same for e4m3 weights, from a sweep on an H100 (each matrix alone, in a
# CUDA graph of launches over weights larger than L2, Llama-3.1-8B's and
# Llama-3.2-1B's shapes). Rows of 8 give enough programs to fill the GPU
# without split-K, and 512 to 1024 one-byte columns keep 16-byte loads.
# Multiplying on the tensor cores instead (weights widened to fp16, x in a
# 16-column tile) was slower at every shape.
def _gemv_config_fp8(N, K):
    if N > K:           # qkv, gate_up
        return (8, 512, 1, 4) if N > 8192 else (8, 1024, 1, 8)
    if N == K:          # o
        return (8, 512, 1, 4) if K >= 4096 else (8, 1024, 1, 4)
    return 8, 1024, 1, 4  # down


def _matmul_out(x, weight, norm_weight, silu_mul, residual, out, scale):
    """The boundary checks of gemv and skinny_matmul; returns out, (M, N), made if None."""
    M, K_in = x.shape
    N, K = weight.shape
    assert K_in == (2 * K if silu_mul else K), f"x has {K_in} features, weight {K}"
    assert x.stride(1) == 1 and weight.stride(1) == 1
    assert x.dtype == weight.dtype if scale is None else (weight.dtype == FP8 and scale.shape == (N,))
    assert norm_weight is None or (norm_weight.shape == (K,) and norm_weight.is_contiguous())
    out = torch.empty(M, N, dtype=x.dtype, device=x.device) if out is None else out
    for t in (out, residual):                   # (M, N) rows in x's dtype; residual optional
        assert t is None or (t.shape == (M, N) and t.dtype == x.dtype and t.stride(1) == 1)
    return out


def gemv(x, weight, norm_weight=None, eps=0.0, silu_mul=False, residual=None, out=None,
         scale=None):
    """gemv_ref in one launch, meant for a few rows (see GEMV_MAX_ROWS). No host sync.
    scale: the (N,) fp32 row scales of an e4m3 weight (quantize_fp8)."""
    M, N, K = x.shape[0], *weight.shape
    out = _matmul_out(x, weight, norm_weight, silu_mul, residual, out, scale)
    if M == 0:
        return out
    BLOCK_N, BLOCK_K, SPLIT_K, num_warps = (_gemv_config if scale is None else _gemv_config_fp8)(N, K)
    BLOCK_K = min(BLOCK_K, max(16, triton.next_power_of_2(K)))
    SPLIT_K = min(SPLIT_K, triton.cdiv(K, BLOCK_K))
    grid = (M, triton.cdiv(N, BLOCK_N), SPLIT_K)
    assert M * grid[1] <= SPLIT_K_NUM_COUNTERS
    part = torch.empty(M, SPLIT_K, N, dtype=torch.float32, device=x.device) if SPLIT_K > 1 else out
    _gemv_kernel[grid](
        x, weight, out,
        weight if norm_weight is None else norm_weight,  # never read without NORM
        out if residual is None else residual,           # never read without RESIDUAL
        out if scale is None else scale,                 # never read without SCALE
        part, _split_k_counts(x.device),                 # never touched without SPLIT_K > 1
        N, K, eps, x.stride(0), weight.stride(0), out.stride(0),
        out.stride(0) if residual is None else residual.stride(0),
        BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, SPLIT_K=SPLIT_K, NORM=norm_weight is not None,
        NORM_BLOCK=min(4096, max(16, triton.next_power_of_2(K))),
        SILU_MUL=silu_mul, RESIDUAL=residual is not None, SCALE=scale is not None, PDL=USE_PDL,
        num_warps=num_warps, **PDL_LAUNCH,
    )
    return out


# ----------------------------------------------------------------------------
# Skinny matmul for decode batches of up to 16 rows
# The GEMV above re-reads W for each further row. This kernel reads W once
# for all the rows of x (a batch of a few users, or a speculative verify step
# of 1 + k rows), on the tensor cores, with the same prologue and epilogue.

# Rows up to which linear takes this kernel: one 16-row tile of x, the least
# a tensor-core dot takes.
SKINNY_MAX_ROWS = 16


@triton.jit
def _prefetch_to_l2(w_ptr, offs_n, k_lo, N, K, stride_wn, NUM_BYTES: tl.constexpr,
                    ELEMENT_BYTES: tl.constexpr):
    """Asks for the first NUM_BYTES of each of the rows offs_n of w, from column k_lo
    on, to be brought into L2: one prefetch per 128-byte line, no registers held,
    nothing waited for. Addresses past the matrix are clamped to its last row or column."""
    offs_line = tl.arange(0, NUM_BYTES // 128) * (128 // ELEMENT_BYTES)
    rows = tl.minimum(offs_n, N - 1)
    cols = tl.minimum(k_lo + offs_line, K - 1)
    tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l",
                              [w_ptr + rows[:, None] * stride_wn + cols[None, :]],
                              dtype=tl.int32, is_pure=False, pack=1)


@triton.jit(do_not_specialize=["M"])  # one compiled variant serves 1 to 16 rows
def _skinny_kernel(
    x_ptr,       # (M, K) input rows; (M, 2 K), gate then up, when SILU_MUL
    w_ptr,       # (N, K) weight, rows contiguous as nn.Linear stores it (or e4m3: SCALE)
    out_ptr,     # (M, N) result
    norm_w_ptr,  # (K,) RMSNorm weight, read only when NORM
    res_ptr,     # (M, N) residual added to the result, read only when RESIDUAL
    scale_ptr,   # (N,) fp32 scale of each e4m3 weight row, read only when SCALE
    part_ptr,    # (SPLIT_K, M, N) fp32 partial sums of the K splits (scratch)
    sq_ptr,      # (SPLIT_K, tiles, BLOCK_M) fp32 partial sums of x^2 (scratch, NORM)
    counts_ptr,  # (tiles,) int32 splits finished per tile, 0 between launches
    M,           # rows
    N,           # output features
    K,           # input features
    eps,         # RMSNorm epsilon
    stride_xm,   # x stride between rows
    stride_wn,   # w stride between rows
    stride_om,   # out stride between rows
    stride_rm,   # residual stride between rows (0: a bias every row shares)
    BLOCK_M: tl.constexpr,   # rows of x in the tile: M rounded up, at least 16
    BLOCK_N: tl.constexpr,   # output features per program
    BLOCK_K: tl.constexpr,   # input features per loop step
    SPLIT_K: tl.constexpr,   # programs sharing one tile's K
    NORM: tl.constexpr,      # x -> norm_w * RMSNorm(x)
    RESCALE: tl.constexpr,   # fp16 NORM: a row's slice too large for fp16 is scaled down
    SILU_MUL: tl.constexpr,  # x -> silu(gate) * up
    RESIDUAL: tl.constexpr,  # out = residual + x W^T
    SCALE: tl.constexpr,     # e4m3 weights, and x quantized as it streams in: an fp8 dot
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 inputs (_dot_precision)
    PDL: tl.constexpr,       # launched with programmatic dependent launch (USE_PDL)
    PREFETCH_BYTES: tl.constexpr,  # of each weight row, asked for into L2 before the PDL wait
):
    """Program (tile, split) computes out[:, tile * BLOCK_N : (tile + 1) * BLOCK_N]
    for every row, over the split-th of SPLIT_K equal runs of K.

    The weight is the dot's left operand: acc (BLOCK_N, BLOCK_M) += W tile
    (BLOCK_N, BLOCK_K) @ f(x)^T (BLOCK_K, BLOCK_M), so the tile's many weight
    rows fill the tensor-core dot's long side and the few rows of x (zeros
    below M) its short one ("swap AB"). Every row shares each weight tile
    read, and Triton pipelines the loads (num_stages tiles in flight). An
    e4m3 weight goes into the dot as it is: each step quantizes its slice of
    f(x) to e4m3, a scale per row over those BLOCK_K columns, and scales the
    step's fp32 product back (gemv_fp8_ref's x_group): no weight is widened.

    Prologue: f(x) is computed on each step's slice, once per program (the
    N / BLOCK_N programs of one split repeat it). RMSNorm's 1 / rms is a
    factor per row, so it leaves the loop: the loop multiplies by norm_w and
    sums x^2, and the epilogue multiplies each row by its 1 / rms (no first
    pass over x). f(x) is computed in fp32 and rounded to x's dtype for the
    dot, with fp32 accumulation. In fp16 that rounding of norm_w * x would
    overflow past 65,504, where x / rms is small. So in fp16 (RESCALE) a
    row's slice whose largest magnitude passes 2^14 is divided by a power of
    two for the dot, and the product multiplied back: exact scalings, and a
    factor of 1 for every slice that fits. bf16 and fp32 need none: their
    exponent is fp32's.

    Split-K and the epilogue are the GEMV's: the last split of a tile to
    finish adds up the fp32 partials (and sums of squares). Memory traffic:
    N * K weights (2 bytes in bf16, 1 in e4m3), plus (N / BLOCK_N) * M * K of
    x from L2, and 2 * SPLIT_K * M * N fp32 partials.
    """
    tl.static_assert(not (NORM and SILU_MUL), "one prologue at a time")
    tl.static_assert(BLOCK_M >= 16, "a tensor-core dot takes at least 16 rows")
    tile, split = tl.program_id(0), tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m, mask_n = offs_m < M, offs_n < N

    # This split's run of K. Its first weight tiles are asked for into L2
    # before the PDL wait (weights depend on no earlier kernel), so they are on
    # their way while that kernel finishes; x, the residual and the split-K
    # counts are read only after.
    k_per_split = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K) * BLOCK_K
    k_lo = split * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    if PDL:
        _prefetch_to_l2(w_ptr, offs_n, k_lo, N, K, stride_wn, PREFETCH_BYTES,
                        w_ptr.dtype.element_ty.primitive_bitwidth // 8)
    _wait_for_inputs(PDL)
    w_ptrs = w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :]  # (BLOCK_N, BLOCK_K) at k = 0
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]  # (BLOCK_M, BLOCK_K) at k = 0
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    sq = tl.zeros([BLOCK_M, BLOCK_K], tl.float32)  # NORM: x^2, summed over K after the loop
    if NORM:  # norm_w is read a step ahead, in registers: Triton pipelines only the dot's inputs
        norm_w = tl.load(norm_w_ptr + k_lo + offs_k, mask=k_lo + offs_k < k_hi, other=0.0)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        mask_k = k0 + offs_k < k_hi
        # -- one weight tile, shared by every row --
        w = tl.load(w_ptrs + k0, mask=mask_n[:, None] & mask_k[None, :], other=0.0)
        # -- the rows' slice of x, through the prologue --
        mask = mask_m[:, None] & mask_k[None, :]                    # (BLOCK_M, BLOCK_K)
        if SILU_MUL:
            gate = tl.load(x_ptrs + k0, mask=mask, other=0.0).to(tl.float32)
            up = tl.load(x_ptrs + K + k0, mask=mask, other=0.0).to(tl.float32)
            a = gate * tl.sigmoid(gate) * up
        else:
            a = tl.load(x_ptrs + k0, mask=mask, other=0.0).to(tl.float32)
        if NORM:
            norm_w_next = tl.load(norm_w_ptr + k0 + BLOCK_K + offs_k,
                                  mask=k0 + BLOCK_K + offs_k < k_hi, other=0.0)
            sq += a * a
            a *= norm_w.to(tl.float32)[None, :]
            norm_w = norm_w_next
        # -- acc += w @ f(x)^T --
        if SCALE:  # x to e4m3, each row's slice scaled by its own largest magnitude
            x_scale = tl.maximum(tl.max(tl.abs(a), 1), 1e-12) / 448.0  # (BLOCK_M,)
            q = (a / x_scale[:, None]).to(w.dtype)
            acc += tl.dot(w, tl.trans(q)) * x_scale[None, :]
        elif RESCALE:  # fp16: 2^e, the least power of two that brings the slice under 2^14
            e = tl.maximum(tl.ceil(tl.log2(tl.max(tl.abs(a), 1) / 16384.0)), 0.0)  # (BLOCK_M,)
            a = (a * tl.exp2(-e)[:, None]).to(x_ptr.dtype.element_ty)
            acc += tl.dot(w, tl.trans(a), input_precision=DOT_PRECISION) * tl.exp2(e)[None, :]
        else:
            a = a.to(x_ptr.dtype.element_ty)
            acc = tl.dot(w, tl.trans(a), acc, input_precision=DOT_PRECISION)
    sum_sq = tl.sum(sq, 1)                                          # (BLOCK_M,)

    mask = mask_n[:, None] & mask_m[None, :]                       # (BLOCK_N, BLOCK_M)
    offs_part = offs_m[None, :] * N + offs_n[:, None]              # in one split's (M, N)
    if SPLIT_K > 1:  # -- the last split of the tile to finish adds up all of them --
        tl.store(part_ptr + split * M * N + offs_part, acc, mask=mask)
        offs_sq = tile * BLOCK_M + offs_m                       # in one split's (tiles, BLOCK_M)
        if NORM:
            tl.store(sq_ptr + split * tl.num_programs(0) * BLOCK_M + offs_sq, sum_sq)
        tl.debug_barrier()  # all of this program's partial is written before it counts in
        if tl.atomic_add(counts_ptr + tile, 1, sem="acq_rel") < SPLIT_K - 1:
            return
        tl.atomic_xchg(counts_ptr + tile, 0)
        acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
        sum_sq = tl.zeros([BLOCK_M], tl.float32)
        for s in range(SPLIT_K):  # ".cg": read the other SMs' partials from L2, not a stale L1
            acc += tl.load(part_ptr + s * M * N + offs_part, mask=mask, cache_modifier=".cg")
            if NORM:
                sum_sq += tl.load(sq_ptr + s * tl.num_programs(0) * BLOCK_M + offs_sq,
                                  cache_modifier=".cg")

    if NORM:
        acc *= tl.rsqrt(sum_sq / K + eps)[None, :]
    if SCALE:  # e4m3 weights: the row's scale, once per output rather than per weight
        acc *= tl.load(scale_ptr + offs_n, mask=mask_n, other=0.0)[:, None]
    y = acc.to(out_ptr.dtype.element_ty)
    if RESIDUAL:
        r = tl.load(res_ptr + offs_m[None, :] * stride_rm + offs_n[:, None], mask=mask)
        y = (r.to(tl.float32) + y.to(tl.float32)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + offs_m[None, :] * stride_om + offs_n[:, None], y, mask=mask)


# (N, K, e4m3 weights, rows) -> (BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages), or
# None where another kernel read the weight faster: the GEMV at one row, except on
# weights of 48 MB and more (the LM head aside); cuBLAS, with its separate norm,
# SiLU-and-mul and add kernels, for bf16 down at K >= 8192 and Llama-3.1-8B's bf16
# gate_up past one row. From sweeps on an H200 (each matrix alone, 1 to 16 rows, in a
# CUDA graph of launches over weights larger than L2; Llama-3.1-8B's, Llama-3.2-1B's
# and Qwen3-0.6B's shapes). In fp8 a step takes 128 columns: x's quantization runs are
# BLOCK_K long, and 256-column runs, or one scale per token, cost SmolLM2-135M more
# than test_fp8_quality_smol allows.
def _skinny_config(N, K, fp8, M):
    if M == 1 and (N * K * (1 if fp8 else 2) < 48e6 or N > 65536):
        return None                                     # the GEMV
    if fp8:
        if K > N:                                       # down
            return (128, 128, 16, 8, 4) if K > 8192 else (64, 128, 8, 4, 6)
        return 64, 128, (1 if N > 4 * K else 4), 4, 4  # qkv, o, gate_up
    if N > 65536:                                       # the LM head
        return 128, 128, 1, 8, 4
    if K >= 8192 or (N > 4 * K and K > 2048 and M > 1):  # down; gate_up at D = 4096
        return None                                     # cuBLAS
    if N > 4 * K:                                       # gate_up
        return (64, 128, 1, 4, 4) if K > 1024 else (64, 128, 4, 4, 3)
    if K > N:                                           # Qwen3-0.6B's o and down
        return (64, 128, 4, 4, 4) if K <= 2048 else (128, 128, 8, 8, 4)
    if K <= 1024:                                       # qkv at D = 1024
        return 64, 256, 2, 4, 3
    return 64, 128, 4, 4, (3 if N > K else 4)          # qkv, o


def skinny_matmul(x, weight, norm_weight=None, eps=0.0, silu_mul=False, residual=None, out=None,
                  scale=None):
    """gemv_ref in one launch, for up to 16 rows (SKINNY_MAX_ROWS) and more, where
    _skinny_config has tiles for the shape and rows. No host sync. scale: the (N,)
    fp32 row scales of an e4m3 weight (quantize_fp8); x then goes into the dot as
    e4m3 too, in runs of BLOCK_K columns (gemv_fp8_ref's x_group)."""
    M, N, K = x.shape[0], *weight.shape
    out = _matmul_out(x, weight, norm_weight, silu_mul, residual, out, scale)
    if M == 0:
        return out
    config = _skinny_config(N, K, scale is not None, M)
    assert config is not None, f"no tiles for {M} x {N} x {K}: linear takes another kernel there"
    BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages = config
    if x.dtype == torch.float32:    # 4-byte rows: fewer columns a step, so the stages fit
        BLOCK_K = min(BLOCK_K, 64)  # in shared memory
    BLOCK_M = max(16, triton.next_power_of_2(M))
    SPLIT_K = min(SPLIT_K, triton.cdiv(K, BLOCK_K))
    grid = (triton.cdiv(N, BLOCK_N), SPLIT_K)
    assert grid[0] <= SPLIT_K_NUM_COUNTERS
    scratch = functools.partial(torch.empty, dtype=torch.float32, device=x.device)
    part = out if SPLIT_K == 1 else scratch(SPLIT_K, M, N)
    sq = out if SPLIT_K == 1 or norm_weight is None else scratch(SPLIT_K, grid[0], BLOCK_M)
    k_run = triton.cdiv(triton.cdiv(K, BLOCK_K), SPLIT_K) * BLOCK_K  # columns of a split
    prefetch = min(num_stages * BLOCK_K, k_run) * weight.element_size()   # bytes of a row
    _skinny_kernel[grid](
        x, weight, out,
        weight if norm_weight is None else norm_weight,  # never read without NORM
        out if residual is None else residual,           # never read without RESIDUAL
        out if scale is None else scale,                 # never read without SCALE
        part, sq, _split_k_counts(x.device),             # never touched without SPLIT_K > 1
        M, N, K, eps, x.stride(0), weight.stride(0), out.stride(0),
        out.stride(0) if residual is None else residual.stride(0),
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, SPLIT_K=SPLIT_K,
        NORM=norm_weight is not None, SILU_MUL=silu_mul, RESIDUAL=residual is not None,
        RESCALE=norm_weight is not None and x.dtype == torch.float16,
        SCALE=scale is not None, DOT_PRECISION=_dot_precision(x.dtype),
        PDL=USE_PDL, PREFETCH_BYTES=max(128, 1 << (prefetch.bit_length() - 1)),
        num_warps=num_warps, num_stages=num_stages, **PDL_LAUNCH,
    )
    return out


def linear_impl(x, weight, norm_weight, eps, silu_mul, residual):  # (N_tok, K) -> (N_tok, N)
    """linear's implementation, chosen here:
    - up to SKINNY_MAX_ROWS rows on the GPU, where _skinny_config has tiles for the shape: the
      skinny matmul, one read of the weight for every row;
    - one row (GEMV_MAX_ROWS) otherwise: the GEMV;
    - more rows: cuBLAS, after the elementwise kernels for f.
    The first two apply f to x as it streams in and add the residual on the way out: a norm,
    activation or add of its own would cost a launch and a wait (~1.5 us) for almost no bytes.
    So a decoder layer takes 6 launches where unfused it takes 11.
    An fp8 weight carries its scales (quantize_fp8). The GEMV and the skinny matmul read it as
    it is, a larger bf16 batch on the GPU takes linear_fp8, and anything else widens it
    (linear_fp8_ref: correct, and slower)."""
    scale = weight.scale if weight.dtype == FP8 else None     # fp8 weights: (N,) fp32
    M = x.shape[0]
    if x.is_cuda and M <= SKINNY_MAX_ROWS and _skinny_config(*weight.shape, scale is not None, M):
        return skinny_matmul(x, weight, norm_weight, eps, silu_mul, residual, scale=scale)
    if x.is_cuda and M <= GEMV_MAX_ROWS:
        return gemv(x, weight, norm_weight, eps, silu_mul, residual, scale=scale)
    if scale is not None and x.is_cuda and x.dtype == torch.bfloat16:   # fp8 tensor cores
        y = linear_fp8(x, weight, norm_weight, eps, silu_mul)          # (N_tok, N)
    else:
        if silu_mul:
            x = silu_and_mul(x) if x.is_cuda else silu_and_mul_ref(x)   # (N_tok, I)
        x = x if norm_weight is None else norm(x, norm_weight, eps)
        y = F.linear(x, weight) if scale is None else linear_fp8_ref(x, weight, scale)  # (N_tok, N)
    return y if residual is None else residual + y


# ----------------------------------------------------------------------------
# fp8 weights (quantization="fp8")
# e4m3 (4 exponent bits, 3 mantissa bits, largest value 448) keeps a relative
# error of at most 1/16 per weight over a wide range. e5m2 would trade a
# mantissa bit for range that a scaled row does not need. Each output channel
# (row of W) has its own fp32 scale, its largest magnitude over 448, so one
# row with large weights does not cost the others their precision. The scale
# factors out of each output, y[n] = scale[n] * sum_k x[k] q[n, k], so a
# kernel multiplies by it once per output, not once per weight. Weights are
# quantized once, at load, after tensor parallelism's shard: each rank's
# scales are those of its own slice. Which kernel runs: pa.linear.

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0   # the largest finite e4m3 value


def _to_fp8(t):                                       # (R, C) -> (R, C) e4m3, (R, 1) fp32
    """Each row scaled so that its largest magnitude is FP8_MAX, rounded to nearest."""
    scale = t.float().abs().amax(-1, keepdim=True).clamp(min=1e-12) / FP8_MAX
    return (t.float() / scale).to(FP8), scale


@torch.no_grad()    # else the scales' autograd graph keeps an fp32 copy of every weight
def quantize_fp8(weight):                             # (N, K) -> (N, K) e4m3
    """A weight as an e4m3 Parameter with its (N,) fp32 row scales as `.scale`,
    an attribute on the parameter as vLLM's loaders set them."""
    q, scale = _to_fp8(weight)
    param = torch.nn.Parameter(q, requires_grad=False)
    param.scale = scale[:, 0].contiguous()
    return param


def linear_fp8_ref(x, weight, scale):                 # (N_tok, K), (N, K) e4m3, (N,) fp32
    """x @ (scale * weight)^T, computed as the kernels do: in fp32, scaled per output."""
    return (F.linear(x.float(), weight.float()) * scale).to(x.dtype)


def gemv_fp8_ref(x, weight, norm_weight=None, eps=0.0, silu_mul=False, residual=None, x_group=0):
    """gemv_ref for an e4m3 weight with its row scales (weight.scale, linear_fp8_ref).
    x_group: f(x) goes through e4m3 too, each row's runs of x_group columns with a
    scale of their own (fp8_activations_ref), as the skinny matmul's fp8 dot takes it."""
    x = _prologue_ref(x, norm_weight, eps, silu_mul)
    y = linear_fp8_ref(fp8_activations_ref(x, x_group) if x_group else x, weight, weight.scale)
    return y if residual is None else (residual.float() + y.float()).to(y.dtype)


def fp8_activations_ref(x, group):                    # (M, K) -> (M, K)
    """x as an fp8 matmul sees it: each row's runs of `group` columns (the last
    one shorter) rounded to e4m3 with a scale of their own, and scaled back."""
    M, K = x.shape
    runs = F.pad(x.float(), (0, -K % group)).view(-1, group)
    q, scale = _to_fp8(runs)
    return (q.float() * scale).view(M, -1)[:, :K].to(x.dtype)


def quantize_rows_ref(x, norm_weight=None, eps=0.0, silu_mul=False):  # (M, K) -> (M, K) e4m3, (M, 1)
    """f(x), f being SiLU-and-mul or RMSNorm (as in gemv_ref), quantized per row (per token)."""
    return _to_fp8(_prologue_ref(x, norm_weight, eps, silu_mul))


@triton.jit
def _quantize_rows_kernel(
    x_ptr,       # (M, K) input rows; (M, 2 K), gate then up, when SILU_MUL
    norm_w_ptr,  # (K,) RMSNorm weight, read only when NORM
    q_ptr,       # (M, K) e4m3 result
    scale_ptr,   # (M,) fp32 scale of each row
    K,           # features
    eps,         # RMSNorm epsilon
    stride_xm,   # x stride between rows
    BLOCK_K: tl.constexpr,   # >= K: one program holds its whole row
    NORM: tl.constexpr,      # x -> norm_w * RMSNorm(x)
    SILU_MUL: tl.constexpr,  # x -> silu(gate) * up
):
    """Program m: row m through the prologue (rounded as gemv's), then its absmax
    scale and its e4m3 values. Reads M * K (2 M * K with SILU_MUL), writes M * K bytes."""
    m = tl.program_id(0)
    offs_k = tl.arange(0, BLOCK_K)
    mask = offs_k < K
    x_row = x_ptr + m * stride_xm
    dtype = x_ptr.dtype.element_ty
    if SILU_MUL:
        gate = tl.load(x_row + offs_k, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(x_row + K + offs_k, mask=mask, other=0.0).to(tl.float32)
        a = (gate * tl.sigmoid(gate) * up).to(dtype)
    else:
        a = tl.load(x_row + offs_k, mask=mask, other=0.0)
    if NORM:
        h = a.to(tl.float32)
        h = (h * tl.rsqrt(tl.sum(h * h, 0) / K + eps)).to(dtype)
        a = tl.load(norm_w_ptr + offs_k, mask=mask, other=0.0) * h
    a = a.to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(a), 0), 1e-12) / 448.0
    tl.store(q_ptr + m * K + offs_k, (a / scale).to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(scale_ptr + m, scale)


def quantize_rows(x, norm_weight=None, eps=0.0, silu_mul=False):  # (M, K) -> (M, K) e4m3, (M, 1)
    """quantize_rows_ref in one launch: the activations of a fp8 matmul, a scale per token."""
    M, K = x.shape[0], x.shape[1] // 2 if silu_mul else x.shape[1]
    assert x.stride(1) == 1 and (norm_weight is None or norm_weight.shape == (K,))
    q = torch.empty(M, K, dtype=FP8, device=x.device)
    scale = torch.empty(M, 1, dtype=torch.float32, device=x.device)
    BLOCK_K = triton.next_power_of_2(K)
    _quantize_rows_kernel[(M,)](
        x, x if norm_weight is None else norm_weight, q, scale, K, eps, x.stride(0),
        BLOCK_K=BLOCK_K, NORM=norm_weight is not None, SILU_MUL=silu_mul,
        num_warps=max(4, min(16, BLOCK_K // 1024)))
    return q, scale


def linear_fp8(x, weight, norm_weight, eps, silu_mul):  # (N_tok, K) -> (N_tok, N)
    """f(x) @ weight.T for an fp8 weight past the GEMV and the skinny matmul, on the GPU in bf16:
    the fp8 tensor cores (torch._scaled_mm). x is quantized too, one scale per token (per row), in
    one launch that also applies f (quantize_rows), and _scaled_mm multiplies by both scales on
    its way out. linear adds the residual."""
    xq, x_scale = quantize_rows(x, norm_weight, eps, silu_mul)   # (N_tok, K) e4m3, (N_tok, 1)
    return torch._scaled_mm(xq, weight.t(), scale_a=x_scale, scale_b=weight.scale[None],
                            out_dtype=x.dtype)                   # (N_tok, N)


# ----------------------------------------------------------------------------
# RoPE fused into the KV store
# Rotary embeddings touch q and k once, just before k is written to the pool:
# one program per token rotates its q in place and its k on the way into the
# pool, and copies v, so rotation and store cost one launch instead of two.
# Qwen3's RMSNorm over each head of q and k rides along (HAS_NORM): at batch 1,
# two launches a layer of their own cost 9% of Qwen3-0.6B's decode step (H200).

@triton.jit
def _rotate_into(src_ptr, offs, dst_ptr, offs_dst, cos, sin, mask, w_ptr, eps,
                 HAS_NORM: tl.constexpr, HALF: tl.constexpr):
    """Rotate the rows (heads) at src_ptr + offs into dst_ptr + offs_dst, in fp32, in the "rotate
    half" layout of transformers (channel i pairs with i + hd/2). With HAS_NORM each row is first
    normalized by the weight at w_ptr, rounded to the dtype before the weight and after it. The
    result is rounded to the source's dtype, then to the destination's (an fp8 pool: _to_cache)."""
    dtype = src_ptr.dtype.element_ty
    x1 = tl.load(src_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src_ptr + offs + HALF, mask=mask, other=0.0).to(tl.float32)
    if HAS_NORM:
        rstd = tl.rsqrt((tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / (2 * HALF) + eps)[:, None]
        offs_w = tl.arange(0, HALF)[None, :]
        x1 = (tl.load(w_ptr + offs_w) * (x1 * rstd).to(dtype)).to(tl.float32)
        x2 = (tl.load(w_ptr + HALF + offs_w) * (x2 * rstd).to(dtype)).to(tl.float32)
    y1, y2 = (x1 * cos - x2 * sin).to(dtype), (x2 * cos + x1 * sin).to(dtype)
    tl.store(dst_ptr + offs_dst, _to_cache(y1, dst_ptr), mask=mask)
    tl.store(dst_ptr + offs_dst + HALF, _to_cache(y2, dst_ptr), mask=mask)


@triton.jit
def _rope_store_kvcache_kernel(
    q_ptr,             # (N_tok, n_heads, hd) queries, rotated in place; rows may be strided
    k_ptr,             # (N_tok, n_kv, hd) new keys, rows may be strided (not modified)
    v_ptr,             # (N_tok, n_kv, hd) new values, rows may be strided
    k_cache_ptr,       # (num_blocks, block_size, n_kv, hd) contiguous key pool
    v_cache_ptr,       # (num_blocks, block_size, n_kv, hd) contiguous value pool
    slot_mapping_ptr,  # (N_tok,) int64 destination slot of each token, -1 = skip
    positions_ptr,     # (N_tok,) int64 position of each token in its sequence
    cos_ptr,           # (max_model_len, hd/2) fp32 cos of position * frequency
    sin_ptr,           # (max_model_len, hd/2) fp32 sin of the same
    q_norm_ptr,        # (hd,) weight of q's per-head RMSNorm (read only with HAS_NORM)
    k_norm_ptr,        # (hd,) weight of k's per-head RMSNorm (read only with HAS_NORM)
    eps,               # both norms' epsilon
    n_heads,           # query heads per token
    n_kv,              # kv heads per token
    stride_qt,         # q stride between tokens
    stride_qh,         # q stride between heads
    stride_kt,         # k stride between tokens
    stride_kh,         # k stride between heads
    stride_vt,         # v stride between tokens
    stride_vh,         # v stride between heads
    N_HEADS_PAD: tl.constexpr,  # n_heads rounded up to a power of two
    N_KV_PAD: tl.constexpr,     # n_kv rounded up to a power of two
    HEAD_DIM: tl.constexpr,     # hd
    HAS_NORM: tl.constexpr,     # normalize each head of q and k before the rotation
    PDL: tl.constexpr,          # launched with programmatic dependent launch (USE_PDL)
):
    """One program handles one token: q and k (with HAS_NORM each head normalized first)
    rotated by the token's position (x1, x2 = halves; x -> [x1 cos - x2 sin, x2 cos + x1 sin],
    in fp32), then k and v stored at slot * n_kv * hd as in store_kvcache. A padding token
    (slot -1) still rotates its q, which nobody reads.
    Memory traffic: q read and written, k and v read and written once."""
    HALF: tl.constexpr = HEAD_DIM // 2
    t = tl.program_id(0)
    # The position, its cos and sin, and the slot are the step's inputs, not an
    # earlier kernel's output: with PDL they are read before the wait.
    pos = tl.load(positions_ptr + t)
    slot = tl.load(slot_mapping_ptr + t)  # int64: slot * n_kv * hd can pass 2**31
    offs_d = tl.arange(0, HALF)
    cos = tl.load(cos_ptr + pos * HALF + offs_d)[None, :]  # (1, HALF)
    sin = tl.load(sin_ptr + pos * HALF + offs_d)[None, :]
    _wait_for_inputs(PDL)  # q, k and v come from the kernel before
    # -- q, in place --
    offs_h = tl.arange(0, N_HEADS_PAD)
    mask = (offs_h < n_heads)[:, None]
    offs_q = t * stride_qt + offs_h[:, None] * stride_qh + offs_d[None, :]  # (N_HEADS_PAD, HALF)
    _rotate_into(q_ptr, offs_q, q_ptr, offs_q, cos, sin, mask, q_norm_ptr, eps, HAS_NORM, HALF)
    # -- k rotated and v copied into the pool --
    if slot < 0:  # padding token: its slot belongs to nobody
        return
    offs_h = tl.arange(0, N_KV_PAD)
    mask = (offs_h < n_kv)[:, None]
    offs_cache = slot * n_kv * HEAD_DIM + offs_h[:, None] * HEAD_DIM + offs_d[None, :]  # (N_KV_PAD, HALF)
    _rotate_into(k_ptr, t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :],
                 k_cache_ptr, offs_cache, cos, sin, mask, k_norm_ptr, eps, HAS_NORM, HALF)
    offs_v = t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :]
    v1, v2 = tl.load(v_ptr + offs_v, mask=mask), tl.load(v_ptr + offs_v + HALF, mask=mask)
    tl.store(v_cache_ptr + offs_cache, _to_cache(v1, v_cache_ptr), mask=mask)
    tl.store(v_cache_ptr + offs_cache + HALF, _to_cache(v2, v_cache_ptr), mask=mask)


def rope_store_kvcache(q, k, v, k_cache, v_cache, slot_mapping, positions, cos, sin,
                       q_norm=None, k_norm=None):
    """rope_store_kvcache_ref in one launch, the per-head norms included. No host sync."""
    _check_cache(k_cache, v_cache)
    N_tok, n_heads, hd = q.shape
    n_kv = k.shape[1]
    assert k.shape == v.shape == (N_tok, n_kv, hd) and k_cache.shape[2:] == (n_kv, hd)
    assert q.dtype == k.dtype == v.dtype and k_cache.dtype in (q.dtype, FP8)
    assert q.stride(2) == 1 and k.stride(2) == 1 and v.stride(2) == 1, "heads must be contiguous"
    for t in (slot_mapping, positions):
        assert t.dtype == torch.int64 and t.shape == (N_tok,) and t.is_contiguous()
    assert cos.shape == sin.shape and cos.shape[1] == hd // 2 and cos.dtype == torch.float32
    assert cos.is_contiguous() and sin.is_contiguous()
    norms = (None, None, 0.0) if q_norm is None else (q_norm.weight, k_norm.weight, q_norm.eps)
    assert q_norm is None or (norms[0].shape == norms[1].shape == (hd,) and k_norm.eps == norms[2])
    if N_tok == 0:
        return
    _rope_store_kvcache_kernel[(N_tok,)](
        q, k, v, k_cache, v_cache, slot_mapping, positions, cos, sin, *norms, n_heads, n_kv,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        N_HEADS_PAD=triton.next_power_of_2(n_heads), N_KV_PAD=triton.next_power_of_2(n_kv),
        HEAD_DIM=hd, HAS_NORM=q_norm is not None, PDL=USE_PDL, **PDL_LAUNCH,
    )


# ----------------------------------------------------------------------------
# The CPU path: torch's fused attention over K/V gathered from the pool
# Triton needs a GPU, so on a CPU the engine calls SDPA, whose CPU kernel is a
# flash attention (tiled online softmax, no score matrix in memory) that skips
# the tiles above the causal diagonal. It takes only 4-D (batch, heads,
# tokens, hd) inputs: the 3-D calls of the references above fall back to the
# "math" SDPA, which materializes every score (8x slower for 2k tokens). Per
# layer, all the step's decode rows share one call and each prefill chunk gets
# one. K/V are gathered token by token, which costs one pass over them
# (transformers' growing cache copies as much every step), except where a lone
# sequence's blocks lie in order in the pool: then SDPA reads them in place.

def _token_slots(block_tables, context_lens, L, block_size, ragged):
    """Pool slot of positions 0 .. L - 1 of each sequence (B, L).

    When the lengths are ragged, positions past a sequence's end repeat its
    last slot: a padded gather then holds real keys, never stale or NaN memory
    that would poison the masked softmax (0 * NaN is NaN)."""
    # every slot of every block in the table, in order: (B, max_blocks * block_size)
    slots = (block_tables[:, :, None] * block_size
             + torch.arange(block_size, device=block_tables.device)).flatten(1)
    if not ragged:
        return slots[:, :L]
    return slots.gather(1, torch.arange(L, device=slots.device).minimum(context_lens[:, None] - 1))


def _gather_tokens(cache, slots):
    """K or V of the given slots: (B, L) slots -> (B, L, n_kv, hd)."""
    rows = cache.view(-1, *cache.shape[2:]).index_select(0, slots.flatten())
    return rows.view(*slots.shape, *cache.shape[2:])


def _read_kv(k_cache, v_cache, block_tables, context_lens, L, ragged, dtype):
    """K and V of positions 0 .. L - 1 of each sequence, (B, n_kv, L, hd) each, in dtype.

    One sequence whose blocks are consecutive in the pool (a fresh pool hands
    blocks out in order, so a lone sequence's usually are) is one run of
    slots: a view of the pool, no copy. Anything else is gathered."""
    block_size = k_cache.shape[1]
    if block_tables.shape[0] == 1:
        ids = block_tables[0, :-(-L // block_size)].tolist()
        if ids == list(range(ids[0], ids[0] + len(ids))):
            start = ids[0] * block_size
            return [c.view(-1, *c.shape[2:])[None, start:start + L].transpose(1, 2).to(dtype)
                    for c in (k_cache, v_cache)]
    slots = _token_slots(block_tables, context_lens, L, block_size, ragged)  # (B, L)
    return [_gather_tokens(c, slots).transpose(1, 2).to(dtype) for c in (k_cache, v_cache)]


_threads_set = {}   # the count set_cpu_threads last set -> torch's count before it


def set_cpu_threads(num_threads=0):
    """torch's threads on the CPU: num_threads, or this rank's share of the cores the engine may
    use. torch counts physical cores, not the CPUs a container or taskset grants, and extra
    threads only contend. (macOS has no affinity mask.) A count this function set is an earlier
    engine's share, so each engine starts from torch's count before that."""
    affinity = getattr(os, "sched_getaffinity", None)
    cores = torch.get_num_threads()
    cores = _threads_set.get(cores, cores)
    cpus = min(cores, len(affinity(0)) if affinity else os.cpu_count())
    n = num_threads or max(1, cpus // tensor_parallel_size())
    _threads_set.clear()
    _threads_set[n] = cores
    torch.set_num_threads(n)


def store_kvcache_sdpa(k, v, k_cache, v_cache, slot_mapping):
    """store_kvcache_ref without the padding mask: a CPU step has no padding
    tokens (no CUDA graphs), and index_copy_ rejects a -1 slot. It copies bytes,
    since torch's CPU index_copy_ takes no fp8."""
    _check_cache(k_cache, v_cache)
    for x, cache in ((k, k_cache), (v, v_cache)):
        rows = cache.view(-1, *cache.shape[2:]).view(torch.uint8)  # (slots, n_kv, hd * bytes)
        rows.index_copy_(0, slot_mapping, as_stored(x, cache).view(torch.uint8))


def paged_attention_decode_sdpa(q, k_cache, v_cache, block_tables, context_lens, scale, out=None):
    """One SDPA call for the whole batch, over K/V padded to the longest context.

    GQA packing, as in the decode kernel: the G query heads of a kv head become
    G query rows of one (B, n_kv) attention, so K/V are neither repeated nor
    broadcast, and no causal mask is needed (the one query sees every key).
    A key mask hides the padding of contexts shorter than the longest."""
    _check_attention_inputs(q, k_cache, v_cache, block_tables, context_lens, out)
    B, n_heads, hd = q.shape
    n_kv = k_cache.shape[2]
    lens = context_lens.tolist()  # host values: free on a CPU
    assert min(lens, default=1) > 0, "context_len 0 (CUDA-graph padding) has no place on this path"
    L = max(lens, default=0)
    ragged = min(lens, default=L) < L
    k, v = _read_kv(k_cache, v_cache, block_tables, context_lens, L, ragged, q.dtype)  # (B, n_kv, L, hd)
    mask = ((torch.arange(L, device=q.device) < context_lens[:, None])[:, None, None, :]
            if ragged else None)                                             # (B, 1, 1, L)
    o = F.scaled_dot_product_attention(q.reshape(B, n_kv, n_heads // n_kv, hd), k, v,
                                       attn_mask=mask, scale=scale)  # (B, n_kv, G, hd)
    o = o.view(B, n_heads, hd)
    return o if out is None else out.copy_(o)


def paged_attention_prefill_sdpa(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens,
                                 scale, out=None):
    """The decode rows of a mixed step in one batched call, then one call per
    prefill chunk: a plain causal mask (is_causal, never materialized) when
    the chunk is the whole sequence, an explicit (T, L) one after a cached prefix."""
    _check_attention_inputs(q, k_cache, v_cache, block_tables, context_lens, out)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device) if out is None else out
    cu, lens = cu_seqlens_q.tolist(), context_lens.tolist()  # host values: free on a CPU
    q_lens = [end - start for start, end in zip(cu, cu[1:])]
    # -- decode rows --
    decode_seqs = [b for b, T in enumerate(q_lens) if T == 1]
    if decode_seqs:
        rows = cu_seqlens_q[decode_seqs].long()                  # (num_decode,) row of each
        out[rows] = paged_attention_decode_sdpa(
            q[rows], k_cache, v_cache, block_tables[decode_seqs], context_lens[decode_seqs], scale)
    # -- prefill chunks --
    for b in (b for b, T in enumerate(q_lens) if T > 1):
        T, L = q_lens[b], lens[b]
        k, v = _read_kv(k_cache, v_cache, block_tables[b:b + 1], None, L, False,
                        q.dtype)  # (1, n_kv, L, hd), widened as the kernels do
        # query j sits at position L - T + j: with a cached prefix (T < L) the diagonal is offset
        pos = torch.arange(L, device=q.device)
        mask = pos <= pos[L - T:, None] if T < L else None  # (T, L)
        o = F.scaled_dot_product_attention(q[None, cu[b]:cu[b + 1]].transpose(1, 2), k, v,
                                           attn_mask=mask, is_causal=mask is None, scale=scale,
                                           enable_gqa=True)  # (1, n_heads, T, hd)
        out[cu[b]:cu[b + 1]] = o[0].transpose(0, 1)
    return out


# ----------------------------------------------------------------------------
# Grammar masks
# A row under a grammar (structured output, tool calls) may only sample what its
# llguidance matcher allows next. The host fills one bitmask row per
# constrained row (bit j of int32 word i allows token 32 i + j: V / 8 bytes);
# nanoserve's structured-output chapter does that. Here the device sets the
# forbidden logits to -inf in place: one launch that reads the bits where they
# are, never unpacking them into a (R, V) tensor nor copying whole logit rows.

@triton.jit
def _apply_token_mask_kernel(
    logits_ptr,       # (B, V) fp32, masked in place
    rows_ptr,         # (R,) int64: the logit row of each bitmask row
    bitmask_ptr,      # (R, W) int32, W = cdiv(V, 32)
    stride_logits,    # logits.stride(0)
    stride_bitmask,   # bitmask.stride(0)
    V,                # vocabulary size
    BLOCK_WORDS: tl.constexpr,   # bitmask words per program: 32 * BLOCK_WORDS tokens
):
    """Program (r, j) masks tokens [32 BLOCK_WORDS j, 32 BLOCK_WORDS (j + 1)) of row r:
    it loads BLOCK_WORDS words, expands each into its 32 bits in registers, and stores
    -inf only where a bit is 0, so an allowed logit is neither read nor written."""
    r, j = tl.program_id(0), tl.program_id(1)
    row = tl.load(rows_ptr + r)
    offs_w = j * BLOCK_WORDS + tl.arange(0, BLOCK_WORDS)                  # (BLOCK_WORDS,)
    words = tl.load(bitmask_ptr + r * stride_bitmask + offs_w, mask=offs_w * 32 < V, other=-1)
    offs_bit = tl.arange(0, 32)                                          # (32,)
    bits = (words[:, None] >> offs_bit[None, :]) & 1                     # (BLOCK_WORDS, 32)
    offs_tok = offs_w[:, None] * 32 + offs_bit[None, :]                  # (BLOCK_WORDS, 32)
    forbidden = (bits == 0) & (offs_tok < V)
    tl.store(logits_ptr + row * stride_logits + offs_tok,
             tl.full((BLOCK_WORDS, 32), float("-inf"), tl.float32), mask=forbidden)


def apply_token_mask_triton(logits, rows, bitmask, BLOCK_WORDS=32):
    """apply_token_mask_ref in one launch (_apply_token_mask_kernel): R x V / 8 bytes
    read, and a write of 4 bytes per forbidden token only."""
    V = logits.shape[1]
    R, W = bitmask.shape
    assert logits.dtype == torch.float32 and logits.stride(1) == 1, "fp32 rows, contiguous"
    assert bitmask.dtype == torch.int32 and bitmask.stride(1) == 1 and W == triton.cdiv(V, 32)
    assert rows.shape == (R,) and rows.dtype == torch.int64
    if R:
        _apply_token_mask_kernel[(R, triton.cdiv(W, BLOCK_WORDS))](
            logits, rows, bitmask, logits.stride(0), bitmask.stride(0), V, BLOCK_WORDS=BLOCK_WORDS)
    return logits


# ----------------------------------------------------------------------------
# Tensor parallelism: the shard rule, and the ranks' collectives
# nanoserve's tensor-parallelism chapter tells the design (what is split, where
# the sums are, why rank 0 alone samples) and runs the ranks; here are the
# primitives it calls. The ranks form torch.distributed's default process
# group (NCCL between GPUs, gloo between CPU processes), and a rank is its rank
# there: one tensor-parallel engine per process.

COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")  # output rows cut
ROW_PARALLEL = ("o_proj", "down_proj")                                     # input columns cut


def tensor_parallel_size():
    return dist.get_world_size() if dist.is_initialized() else 1


def shard(tensor, name, size):
    """This rank's part of the checkpoint tensor `name` (a Hugging Face key) in a
    model cut over `size` ranks. A column-parallel weight (N, K) keeps the rank's
    N / size rows (its heads, or its channels of I); a row-parallel one the same
    share of its K input columns (a bias, 1-D, keeps the rows of its weight);
    embeddings, norms (Qwen3's per-head ones too) and the LM head stay whole.
    E.g. SmolLM2's k_proj (3 KV heads x 64 rows, 576) over 3 ranks: rank 1 keeps
    rows 64-127, its one KV head; its o_proj (576, 9 x 64) keeps columns 192-383,
    those of its 3 query heads."""
    proj = name.split(".")[-2]
    dim = 0 if proj in COLUMN_PARALLEL else 1 if proj in ROW_PARALLEL else None
    if dim is None or size == 1:
        return tensor
    assert tensor.shape[dim] % size == 0, f"{name} {tuple(tensor.shape)} does not split by {size}"
    return tensor.chunk(size, dim)[dist.get_rank() if dist.is_initialized() else 0]


def broadcast_from_rank0(t):
    """Rank 0's t into every rank's t, in place; nothing without ranks. On the GPU
    it is queued on the stream like a kernel: no host sync."""
    if tensor_parallel_size() > 1:
        dist.broadcast(t, src=0)
    return t


def min_over_ranks(n, device):
    """The least of every rank's n (each rank's KV pool, sized from its own memory)."""
    if tensor_parallel_size() == 1:
        return n
    t = torch.tensor([n], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


# ----------------------------------------------------------------------------
# ATTENTION: the (rope_store, attend) pair of each implementation
# The table that the first section describes, here because it names the kernels
# defined in between.

def _attend_with(decode, prefill):
    def attend(q, k_cache, v_cache, meta, scale):
        if meta.is_decode:
            return decode(q, k_cache, v_cache, meta.block_tables, meta.context_lens, scale)
        return prefill(q, k_cache, v_cache, meta.block_tables, meta.cu_seqlens_q,
                       meta.context_lens, scale)
    return attend


ATTENTION = {
    # the Triton kernels: rotation and store in one launch, then flash-decoding or varlen prefill
    "triton": (rope_store_kvcache, _attend_with(paged_attention_decode, paged_attention_prefill)),
    # the CPU path: torch's flash attention over K/V read from the pool
    "sdpa": (functools.partial(rope_store_kvcache_ref, store=store_kvcache_sdpa),
             _attend_with(paged_attention_decode_sdpa, paged_attention_prefill_sdpa)),
    # the plain references, one sequence at a time: what both are tested against
    "torch": (rope_store_kvcache_ref,
              _attend_with(paged_attention_decode_ref, paged_attention_prefill_ref)),
}
