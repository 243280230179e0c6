"""Where a row's logits depend on its batch: one minimal in-process reproduction per source, in each llama.cpp build.

Each probe computes the same row (the same token at the same position after the same prompt) twice, in two
batches that differ in one thing only, and compares the two logit vectors bit for bit. Against the row decoded
alone after its prompt prefilled whole:

* ``decode_beside_N``: the row beside N other sequences' decode rows (llamafile's sgemm takes 2 rows or more,
  repacking's GEMM each 4);
* ``prefill_beside_decode``: the prompt prefilled in chunks of 32 beside two other sequences' decode rows, as the
  engine prefills an arrival while others decode (a chunk's first token is multiplied beside single rows:
  llamafile's sgemm takes only the rest);
* ``prefill_last_chunk_N``: the prompt prefilled with a last chunk of N tokens (the tiled K-quant matmul: 8 or more);
* ``last_token_in_its_chunk``: the prompt's last token computed inside its prompt's chunk, not as a decode row;
* ``prefix_copied_from_another_slot``, ``prefix_restored_from_ram``: the prompt cache's two sources of cells.

And beside one other decode row, against the same with that neighbour holding 40 cells: ``kv_length`` (it holds
~450: the attention's KV length is the longest stream's, padded to 256), ``threads_1_vs_2`` (1 thread, not 2).

Each probe runs in a child process per configuration: ``default`` (the llama-cpp-python wheel: llamafile's sgemm
and weight repacking on) and ``deterministic`` (tether's batch-invariant build, no repacking). A probe is
``identical`` when every logit is bit-equal. Run: ``.venv/bin/python bench/batch_variance.py``; the last line is
one JSON object.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
import time
from typing import Any

import numpy as np

PROMPT = (
    "<|im_start|>system\nYou are a careful assistant who answers in full sentences.<|im_end|>\n<|im_start|>user\n"
    "Explain why the sky is blue, then why sunsets are red, in three short paragraphs.<|im_end|>\n"
    "<|im_start|>assistant\n"
)
NEIGHBOUR = "<|im_start|>user\nWrite a haiku about a lighthouse keeper and the winter sea.<|im_end|>\n"
LONG = " ".join(f"word{i}" for i in range(150))


SEQS = 6


class Probe:
    """One llama.cpp context of ``SEQS`` separate sequences over the model, and the decodes the probes need."""

    def __init__(self, lib: Any, path: str, repack: bool, threads: int) -> None:
        self.lib = lib
        mp = lib.llama_model_default_params()
        mp.use_extra_bufts = repack
        self.model = lib.llama_model_load_from_file(path.encode(), mp)
        self.vocab = lib.llama_model_get_vocab(self.model)
        self.n_vocab = lib.llama_vocab_n_tokens(self.vocab)
        cp = lib.llama_context_default_params()
        cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_seq_max = SEQS * 1024, 512, 512, SEQS
        cp.n_threads = cp.n_threads_batch = threads
        cp.kv_unified = False
        cp.flash_attn_type = lib.LLAMA_FLASH_ATTN_TYPE_DISABLED
        self.ctx = lib.llama_init_from_model(self.model, cp)
        self.memory = lib.llama_get_memory(self.ctx)
        self.batch = lib.llama_batch_init(512 + SEQS, 0, 1)

    def tokens(self, text: str) -> list[int]:
        buf = (ctypes.c_int32 * 2048)()
        n = self.lib.llama_tokenize(self.vocab, text.encode(), len(text.encode()), buf, 2048, True, True)
        return list(buf[:n])

    def decode(self, rows: list[tuple[int, int, int, bool]]) -> list[np.ndarray]:
        """Decode (token, position, sequence, logits) rows in one batch; the logits of the rows that asked."""
        b = self.batch
        for i, (token, pos, seq, logits) in enumerate(rows):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = token, pos, 1, int(logits)
            b.seq_id[i][0] = seq
        b.n_tokens = len(rows)
        if self.lib.llama_decode(self.ctx, b) != 0:
            raise RuntimeError("llama_decode failed")
        out = []
        for i, row in enumerate(rows):
            if row[3]:
                view = np.ctypeslib.as_array(self.lib.llama_get_logits_ith(self.ctx, i), shape=(self.n_vocab,))
                out.append(view.copy())
        return out

    def prefill(self, seq: int, tokens: list[int], chunk: int = 512) -> None:
        for at in range(0, len(tokens), chunk):
            part = tokens[at : at + chunk]
            self.decode([(t, at + i, seq, False) for i, t in enumerate(part)])

    def fresh(self, prompts: list[tuple[int, list[int]]], chunk: int = 512) -> None:
        """Empty cells, then each (sequence, prompt)'s prompt but its last token prefilled."""
        self.lib.llama_memory_clear(self.memory, True)
        for seq, tokens in prompts:
            self.prefill(seq, tokens[:-1], chunk)

    def last_rows(self, prompts: list[tuple[int, list[int]]]) -> np.ndarray:
        """Each prompt's last token as a decode row, all in one batch; the first prompt's logits."""
        rows = sorted((tokens[-1], len(tokens) - 1, seq, True) for seq, tokens in prompts)
        logits = self.decode(sorted(rows, key=lambda row: row[2]))
        return logits[sorted(seq for seq, _ in prompts).index(prompts[0][0])]


def _compare(a: np.ndarray, b: np.ndarray) -> dict[str, Any]:
    differ = int(np.count_nonzero(a.view(np.uint32) != b.view(np.uint32)))
    return {
        "identical": differ == 0,
        "logits_differing": differ,
        "max_abs_diff": float(np.max(np.abs(a - b))),
        "argmax_same": int(np.argmax(a)) == int(np.argmax(b)),
    }


def run_probes(path: str, repack: bool) -> dict[str, Any]:
    """Every probe on one model in this process's llama.cpp build (see the module docstring)."""
    import llama_cpp as lib

    lib.llama_backend_init()
    p = Probe(lib, path, repack, threads=2)
    prompt = p.tokens(PROMPT)
    others = [p.tokens(f"<|im_start|>user\nQuestion {i}: {NEIGHBOUR}") for i in range(SEQS - 2)]
    long_other = p.tokens(NEIGHBOUR + LONG)
    mine = (0, prompt)
    out: dict[str, Any] = {}

    p.fresh([mine])
    alone = p.last_rows([mine])
    beside = [(1 + i, tokens) for i, tokens in enumerate(others)]
    for n in (1, 3, 4):  # repacking: a GEMM for each 4 rows, a GEMV for the rest
        p.fresh([mine, *beside[:n]])
        out[f"decode_beside_{n}"] = _compare(p.last_rows([mine, *beside[:n]]), alone)

    # the prompt prefilled in chunks of 32 beside two other sequences' decode rows, as the engine prefills an arrival
    # while others decode: llama.cpp splits the batch into micro-batches of one token per sequence first, so one
    # token of each chunk is multiplied beside single rows (no llamafile sgemm), the rest as a block (sgemm)
    head = prompt[:-1]
    p.fresh(beside[:2])
    for at in range(0, len(head), 32):
        part = head[at : at + 32]
        rows = [(tokens[-1], len(tokens) - 1, seq, True) for seq, tokens in beside[:2]]
        p.decode(rows + [(t, at + i, 3, False) for i, t in enumerate(part)])
        for seq, tokens in beside[:2]:
            lib.llama_memory_seq_rm(p.memory, seq, len(tokens) - 1, -1)
    out["prefill_beside_decode"] = _compare(p.last_rows([(3, prompt)]), alone)

    for size in (16, 5):  # the tiled K-quant matmul takes micro-batches of 8 rows or more, vec_dot fewer
        p.fresh([mine], chunk=len(head) - size)
        out[f"prefill_last_chunk_{size}"] = _compare(p.last_rows([mine]), alone)

    p.fresh([])
    in_chunk = p.decode([(t, i, 0, i == len(prompt) - 1) for i, t in enumerate(prompt)])[0]
    out["last_token_in_its_chunk"] = _compare(in_chunk, alone)

    other = others[0]
    p.fresh([mine, (1, other)])
    short = p.last_rows([mine, (1, other)])
    p.fresh([mine, (1, long_other)])  # the attention's KV length: the longest stream's, padded to 256
    out["kv_length"] = _compare(p.last_rows([mine, (1, long_other)]), short)

    p.fresh([mine, (1, other)])
    lib.llama_set_n_threads(p.ctx, 1, 1)
    out["threads_1_vs_2"] = _compare(p.last_rows([mine, (1, other)]), short)
    lib.llama_set_n_threads(p.ctx, 2, 2)

    p.fresh([(2, prompt)])
    lib.llama_memory_seq_cp(p.memory, 2, 0, -1, -1)
    out["prefix_copied_from_another_slot"] = _compare(p.last_rows([mine]), alone)

    p.fresh([mine])
    size = lib.llama_state_seq_get_size(p.ctx, 0)
    saved = (ctypes.c_uint8 * size)()
    lib.llama_state_seq_get_data(p.ctx, saved, size, 0)
    p.fresh([])
    lib.llama_state_seq_set_data(p.ctx, saved, size, 0)
    out["prefix_restored_from_ram"] = _compare(p.last_rows([mine]), alone)
    out["system_info"] = lib.llama_print_system_info().decode().strip()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", nargs=2, metavar=("GGUF", "REPACK"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(run_probes(args.child[0], args.child[1] == "1")))
        return
    from benchstats import emit
    from tether.engines.llamacpp import invariant
    from tether.models import PACKAGED, default_model_path, pulled_path

    library = invariant.built()
    if library is None:
        sys.exit(f"the batch-invariant build is missing: {invariant.BUILD_HINT}")
    gemma = pulled_path(PACKAGED["gemma3-270m"])
    models = {"smollm2-135m": default_model_path(), "gemma3-270m": gemma if gemma.is_file() else None}
    configs = {"default": (None, True), "deterministic": (library, False)}
    results: dict[str, Any] = {}
    started = time.monotonic()
    for name, path in models.items():
        if path is None:
            results[name] = {"skipped": "not installed"}
            continue
        for config, (lib_dir, repack) in configs.items():
            env = dict(os.environ)
            env.pop("LLAMA_CPP_LIB_PATH", None)
            if lib_dir is not None:
                env["LLAMA_CPP_LIB_PATH"] = str(lib_dir)
                env.update(invariant.RUNTIME_ENV)
            done = subprocess.run(
                [sys.executable, __file__, "--child", str(path), "1" if repack else "0"],
                env=env,
                capture_output=True,
                text=True,
                timeout=600,
                check=True,
            )
            results.setdefault(name, {})[config] = json.loads(done.stdout.strip().splitlines()[-1])
    for name, by_config in results.items():
        for config, probes in by_config.items():
            if isinstance(probes, dict):
                cells = "  ".join(
                    f"{probe}={'=' if r['identical'] else r['logits_differing']}"
                    for probe, r in probes.items()
                    if isinstance(r, dict)
                )
                print(f"{name:>13} {config:>13}: {cells}", file=sys.stderr)
    emit({"bench": "batch_variance", "seconds": round(time.monotonic() - started, 1), "models": results})


if __name__ == "__main__":
    main()
