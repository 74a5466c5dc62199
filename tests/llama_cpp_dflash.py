"""llama.cpp running a DFlash draft beside its target, through llama-cpp-python's low-level bindings: the
oracle for ember's draft (tests/test_dflash.py).

What llama.cpp's common/speculative.cpp does, one sequence: the target decodes the context with its
layer inputs extracted at the draft's target_layers (llama_set_embeddings_layer_inp, a C++ symbol of
libllama bound here by its mangled name); the draft context (ctx_other = the target's, non-causal)
takes those features as an embedding batch — the KV injection — and then the noise block
[last token, mask, ...] as a token batch, whose logits are the proposals' distributions.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

llama_cpp = pytest.importorskip("llama_cpp")
_lib = llama_cpp.llama_cpp._lib
_set_layer_inp = _lib._Z30llama_set_embeddings_layer_inpP13llama_contextjb
_set_layer_inp.argtypes, _set_layer_inp.restype = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_bool], None
_get_layer_inp = _lib._Z30llama_get_embeddings_layer_inpP13llama_contextj
_get_layer_inp.argtypes, _get_layer_inp.restype = [ctypes.c_void_p, ctypes.c_uint32], ctypes.POINTER(ctypes.c_float)


@dataclass(frozen=True)
class DraftRun:
    features: np.ndarray  # [context, len(target_layers) x hidden]: the target's layer inputs, fc's order
    logits: np.ndarray  # [k, vocab]: the draft's logits at the block's mask positions


def load_model(path: Path) -> object:
    llama_cpp.llama_backend_init()
    model = llama_cpp.llama_model_load_from_file(str(path).encode(), llama_cpp.llama_model_default_params())
    if not model:
        raise RuntimeError(f"llama.cpp could not load {path}")
    return model


def run_draft(target: Path, draft: Path, target_layers: tuple[int, ...], context: list[int], last: int, mask: int,
              k: int, features: np.ndarray | None = None) -> DraftRun:
    """The target decodes `context` (positions 0..n-1); the draft injects its features (or the given
    `features` [n, width] instead) and runs the block [last, mask x k] at positions n..n+k."""
    tgt, dft = load_model(target), load_model(draft)
    ctx_t = _context(tgt)
    hidden = llama_cpp.llama_model_n_embd(tgt)
    for layer in target_layers:
        _set_layer_inp(ctx_t, layer, True)
    n = len(context)
    batch = llama_cpp.llama_batch_init(n, 0, 1)
    for i, token in enumerate(context):
        batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.seq_id[i][0], batch.logits[i] = token, i, 1, 0, i == n - 1
    batch.n_tokens = n
    if llama_cpp.llama_decode(ctx_t, batch) != 0:
        raise RuntimeError("llama_decode of the target failed")
    captured = np.concatenate([np.ctypeslib.as_array(_get_layer_inp(ctx_t, layer), (n, hidden)).copy()
                               for layer in target_layers], axis=1)
    llama_cpp.llama_batch_free(batch)
    rows = np.ascontiguousarray(captured if features is None else features, np.float32)

    ctx_d = _context(dft, other=ctx_t)
    llama_cpp.llama_set_causal_attn(ctx_d, False)  # DFlash blocks are not causal (speculative.cpp)
    inject = llama_cpp.llama_batch_ext_init(ctx_d)
    for i in range(n):
        row = rows[i]
        embd = llama_cpp.llama_embd(row.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), 1, rows.shape[1])
        idx = llama_cpp.llama_batch_ext_add_embd(inject, 0, embd)
        pos = (ctypes.c_int32 * 4)(i, i, i, 0)
        llama_cpp.llama_batch_ext_set_pos(inject, idx, pos)
    if llama_cpp.llama_process(ctx_d, llama_cpp.LLAMA_PROCESS_TYPE_DECODE, inject) != 0:
        raise RuntimeError("llama_process of the injection failed")
    block = llama_cpp.llama_batch_ext_init(ctx_d)
    for i, token in enumerate([last] + [mask] * k):
        idx = llama_cpp.llama_batch_ext_add_token(block, 0, token)
        llama_cpp.llama_batch_ext_set_pos(block, idx, (ctypes.c_int32 * 1)(n + i))
        llama_cpp.llama_batch_ext_set_output_logits(block, idx, True)
    if llama_cpp.llama_process(ctx_d, llama_cpp.LLAMA_PROCESS_TYPE_DECODE, block) != 0:
        raise RuntimeError("llama_process of the noise block failed")
    vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(tgt))
    # every block token outputs (llama_get_logits_ith counts outputs, not batch indices): rows 1..k are the masks'
    logits = np.stack([np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx_d, i), (vocab,)).copy()
                       for i in range(1, k + 1)])
    for b in (inject, block):
        llama_cpp.llama_batch_ext_free(b)
    llama_cpp.llama_free(ctx_d)
    llama_cpp.llama_free(ctx_t)
    llama_cpp.llama_model_free(dft)
    llama_cpp.llama_model_free(tgt)
    return DraftRun(captured, logits)


def _context(model: object, other: object = None) -> object:
    params = llama_cpp.llama_context_default_params()
    params.n_ctx = params.n_batch = params.n_ubatch = 256
    params.n_threads = params.n_threads_batch = 2
    params.type_k = params.type_v = llama_cpp.GGML_TYPE_F32  # an f32 cache, as ember's default
    if other is not None:
        params.ctx_other = other
    ctx = llama_cpp.llama_init_from_model(model, params)
    if not ctx:
        raise RuntimeError("llama.cpp could not create a context")
    return ctx
