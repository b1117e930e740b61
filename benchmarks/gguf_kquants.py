"""Our engine against llama.cpp on a Q4_K_M file, the GGUF type most downloaded models come in (Q4_K for most
matrices, Q6_K for the output and part of attn_v / ffn_down): decode tok/s and TTFT side by side, the same prompt
token ids, greedy, EOS ignored, 2 threads each.

No k-quant checkpoint ships with the project (the default model's rows of 576 columns do not divide into k-quant
blocks of 256), so the file is made here: a Llama with the default model's tokenizer and chat template (its GGUF
metadata copied) and the geometry of a 1B-class model cut to 8 layers (hidden 2048, 32 heads of 64, 4 KV heads,
feed-forward 5632, an output matrix of its own), random weights (normal, std 0.02) written as F16, then quantized
to Q4_K_M by llama.cpp's own quantizer (llama_model_quantize, in the peer's environment). Random weights give
meaningless text, but a decode step reads and multiplies the same bytes whatever they hold, so the speeds are
those of a trained model of this shape; no perplexity is measured.

Usage: python -m benchmarks.gguf_kquants [--contexts 128,1024] [--reps 3] [--folder gguf-kquants]
Needs llama.cpp built once (python -m benchmarks.gguf_llamacpp --setup). Writes results/<folder>/<folder>.json,
.md. The files (~1.1 GB F16, ~0.3 GB Q4_K_M) are made once into the user cache.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from .gguf_llamacpp import PEER, ROOT, THREADS, peer_dir, peer_python, prompts, run_worker

HIDDEN, HEADS, KV_HEADS, INTER, LAYERS = 2048, 32, 4, 5632, 8
NEW_TOKENS = 64
DENSE = dict(kv_cache_ratio=1.0, csa2_topk=0)
ROWS = {"ours, GGUF blocks": ({}, DENSE),  # the default x mode (int16 where AVX-512 VNNI and BF16 are)
        "ours, GGUF blocks, float32 x": ({"DSV41_GGUF_X": "float32"}, DENSE),
        # x as two bf16 terms in the Q4_K and Q6_K products (the default where AVX-512 BF16 is but not VNNI)
        "ours, GGUF blocks, bf16 x": ({"DSV41_GGUF_X": "bf16"}, DENSE),
        # x rounded to int8 per 32 in the Q4_K products (Q6_K: two bf16 terms), as llama.cpp rounds it per 256
        "ours, GGUF blocks, int8 x": ({"DSV41_GGUF_X": "int8"}, DENSE),
        "ours, defaults (CED + CSA2)": ({}, {})}


def files() -> tuple[Path, Path]:
    from engine.paths import user_cache_dir

    folder = user_cache_dir() / "benchmarks" / "kquants"
    name = f"llama-{LAYERS}x{HIDDEN}-{INTER}"
    return folder / f"{name}-F16.gguf", folder / f"{name}-Q4_K_M.gguf"


def make_f16(path: Path) -> None:
    """The synthetic Llama as F16 (norms F32), with the default model's tokenizer metadata."""
    import gguf
    import numpy as np

    from engine.loader import default_gguf_path

    reader = gguf.GGUFReader(str(default_gguf_path()))
    vocab = int(reader.fields["llama.vocab_size"].contents())
    path.parent.mkdir(parents=True, exist_ok=True)
    scratch = path.with_suffix(".partial")
    writer = gguf.GGUFWriter(str(scratch), "llama")
    geometry = {"llama.block_count": LAYERS, "llama.embedding_length": HIDDEN, "llama.feed_forward_length": INTER,
                "llama.attention.head_count": HEADS, "llama.attention.head_count_kv": KV_HEADS,
                "llama.rope.dimension_count": HIDDEN // HEADS, "general.file_type": 1,
                "general.name": f"synthetic llama {LAYERS}x{HIDDEN}"}
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        kind = field.types[0]
        value = geometry.get(field.name, field.contents())
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, value, kind, sub_type=sub)
    rng = np.random.default_rng(0)
    kv = KV_HEADS * (HIDDEN // HEADS)
    shapes = {"token_embd.weight": (vocab, HIDDEN), "output.weight": (vocab, HIDDEN)}
    for i in range(LAYERS):
        shapes.update({f"blk.{i}.attn_q.weight": (HIDDEN, HIDDEN), f"blk.{i}.attn_k.weight": (kv, HIDDEN),
                       f"blk.{i}.attn_v.weight": (kv, HIDDEN), f"blk.{i}.attn_output.weight": (HIDDEN, HIDDEN),
                       f"blk.{i}.ffn_gate.weight": (INTER, HIDDEN), f"blk.{i}.ffn_up.weight": (INTER, HIDDEN),
                       f"blk.{i}.ffn_down.weight": (HIDDEN, INTER)})
    for name, shape in shapes.items():
        writer.add_tensor(name, (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(np.float16))
    for i in range(LAYERS):
        for norm in ("attn_norm", "ffn_norm"):
            writer.add_tensor(f"blk.{i}.{norm}.weight", np.ones(HIDDEN, dtype=np.float32))
    writer.add_tensor("output_norm.weight", np.ones(HIDDEN, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    scratch.replace(path)


def quantize_worker(source: str, target: str) -> dict:
    """In the peer's environment: llama.cpp's quantizer, F16 -> Q4_K_M."""
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M
    params.nthread = THREADS
    status = llama_cpp.llama_model_quantize(source.encode(), target.encode(), params)
    return {"status": int(status)}


def ensure_files() -> Path:
    f16, q4km = files()
    if q4km.exists():
        return q4km
    if not f16.exists():
        print(f"writing {f16} ...", flush=True)
        make_f16(f16)
    print(f"quantizing to {q4km.name} with llama.cpp ...", flush=True)
    scratch = q4km.with_suffix(".partial")
    proc = subprocess.run([str(peer_python()), "-m", "benchmarks.gguf_kquants", "--quantize", str(f16), str(scratch)],
                          cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0 or json.loads(proc.stdout.strip().splitlines()[-1])["status"] != 0:
        raise RuntimeError(f"llama.cpp's quantizer failed:\n{proc.stderr[-2000:]}")
    scratch.replace(q4km)
    f16.unlink()  # 1.1 GB no longer needed
    return q4km


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gguf_kquants", description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", default="128,1024")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--folder", default="gguf-kquants")
    parser.add_argument("--quantize", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quantize:
        print(json.dumps(quantize_worker(*args.quantize)))
        return 0
    if not (peer_dir() / "dsv41-build.txt").exists():
        print("llama.cpp is not built yet: run python -m benchmarks.gguf_llamacpp --setup first (minutes)")
        return 1
    import torch
    from gguf import GGMLQuantizationType

    from benchmarks.common import machine, write_results
    from engine.gguf_index import tensor_index

    torch.set_num_threads(THREADS)
    gguf = ensure_files()
    index = tensor_index(str(gguf))
    formats: dict[str, int] = {}
    for info in index.values():
        kind = GGMLQuantizationType(info.type_id).name
        formats[kind] = formats.get(kind, 0) + info.nbytes
    contexts = [int(c) for c in args.contexts.split(",")]
    built = [prompts(n) for n in contexts]
    names = [str(n) for n in contexts]
    base = {"gguf": str(gguf), "model_path": str(gguf), "n_ctx": 4096, "new_tokens": NEW_TOKENS, "names": names,
            "prompts": [ids for ids, _ in built], "questions": [q for _, q in built]}
    # the modes this build has (DSV41_CPU_KERNEL_FLAGS=-mno-avx512f: the AVX2 build, float32 and int16 only)
    from engine.kernels.gguf_blocks import x_modes

    have = set(x_modes())
    rows = [PEER, *(row for row, (env, _) in ROWS.items() if env.get("DSV41_GGUF_X", "float32") in have)]
    raw: dict[str, list[dict]] = {row: [] for row in rows}
    for rep in range(args.reps):
        for row in rows:
            start = time.time()
            env, knobs = ROWS.get(row, ({}, {}))
            raw[row].append(run_worker(row, dict(base, knobs=knobs), env=env if row in ROWS else None))
            print(f"rep {rep + 1}/{args.reps} {row}: {time.time() - start:.0f} s", flush=True)
    summary = []
    for row in rows:
        for name, n in zip(names, contexts, strict=True):
            tok_s = statistics.median(r["runs"][name]["decode_tok_s"] for r in raw[row])
            ttft = statistics.median(r["runs"][name]["ttft_s"] for r in raw[row])
            peer_tok_s = statistics.median(r["runs"][name]["decode_tok_s"] for r in raw[PEER])
            peer_ttft = statistics.median(r["runs"][name]["ttft_s"] for r in raw[PEER])
            summary.append({"row": row, "prompt_tokens": n, "decode_tok_s": tok_s, "x_peer": tok_s / peer_tok_s,
                            "ttft_s": ttft, "ttft_x_peer": ttft / peer_ttft,
                            "weights": raw[row][0].get("weights", "the file")})
    # bytes a decode step reads: every tensor but the embedding (one row of it), and the KV it attends to (ours as
    # its worker reports; llama.cpp's f16 KV of the prompt and half the reply)
    from benchmarks.speed.core import read_bandwidth
    from engine.kernels.gguf_blocks import x_mode

    step_weights = sum(info.nbytes for name, info in index.items() if name != "token_embd.weight")
    bandwidth = read_bandwidth(torch.device("cpu"))["bytes_per_s"]
    for s in summary:
        n = s["prompt_tokens"]
        kv = (statistics.median(r["runs"][str(n)]["kv_read_per_token"] for r in raw[s["row"]]) if s["row"] in ROWS
              else LAYERS * 2 * KV_HEADS * (HIDDEN // HEADS) * 2 * (n + NEW_TOKENS // 2))
        s["bytes_per_token"] = step_weights + kv
        s["share_of_bound"] = s["bytes_per_token"] * s["decode_tok_s"] / bandwidth
    m = machine(torch.device("cpu"))
    total = sum(formats.values())
    held = ", ".join(f"{k} {v / 1e6:.0f} MB" for k, v in sorted(formats.items(), key=lambda kv: -kv[1]))
    lines = [f"{gguf.name} ({total / 1e6:.0f} MB of tensors: {held}), {m['cpu']}, {THREADS} threads; greedy, "
             f"{NEW_TOKENS} tokens, EOS ignored; medians of {args.reps} interleaved runs, each a fresh process. "
             f"Our default x mode here: {x_mode()}. Read bandwidth {bandwidth / 1e9:.1f} GB/s (measured after the "
             "runs); MB read a step: the weights but the embedding, and the KV.", "",
             "| row | prompt tokens | decode tok/s | × llama.cpp | TTFT | × llama.cpp | MB read a step | "
             "% of the bandwidth bound | weights held |",
             "|---|---|---|---|---|---|---|---|---|"]
    for s in summary:
        lines.append(f"| {s['row']} | {s['prompt_tokens']:,} | {s['decode_tok_s']:.1f} | {s['x_peer']:.2f} | "
                     f"{s['ttft_s'] * 1e3:,.0f} ms | {s['ttft_x_peer']:.2f} | {s['bytes_per_token'] / 1e6:.0f} | "
                     f"{s['share_of_bound'] * 100:.0f} % | {s['weights']} |")
    table = "\n".join(lines) + "\n"
    write_results(args.folder, {"machine": m, "threads": THREADS, "new_tokens": NEW_TOKENS, "reps": args.reps,
                                "gguf": gguf.name, "geometry": {"hidden": HIDDEN, "heads": HEADS, "kv_heads": KV_HEADS,
                                                                 "inter": INTER, "layers": LAYERS},
                                "x_mode": x_mode(), "bandwidth_gb_s": bandwidth / 1e9,
                                "tensor_bytes": formats, "rows": summary, "raw": raw}, table)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
