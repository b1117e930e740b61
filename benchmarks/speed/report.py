"""bench.json, bench.md (tables + the issue's targets, met or not) and PNG plots from one bench payload."""

from __future__ import annotations

import json
from pathlib import Path

MiB = 2**20


def bandwidth_fraction(row: dict, weight_bytes: int, bw: float | None) -> tuple[float | None, float | None]:
    """(bytes read per decoded token, fraction of the read-bandwidth bound reached)."""
    tok_s = row.get("decode_tok_s")
    per_token = weight_bytes + (row.get("kv_read_per_token") or 0)
    if not tok_s or not bw:
        return per_token, None
    return per_token, per_token * tok_s / bw


def annotate(payload: dict) -> None:
    """Add derived figures (ratios, bandwidth fractions, turn peaks) to every row, in place."""
    bw = payload["sections"].get("bandwidth", {}).get("bytes_per_s")
    weights = payload["weight_read_bytes"]

    own = payload.get("row_weight_bytes", {})  # rows whose model holds its weights differently

    def fill(rows: dict, weight_bytes: int, resident: int):
        base = rows.get("transformers sdpa") or rows.get("transformers")
        for name, row in rows.items():
            row_weights = own.get(name, weight_bytes)
            row["bytes_per_token"], row["bandwidth_fraction"] = bandwidth_fraction(row, row_weights, bw)
            row["turn_peak_bytes"] = own.get(name, resident) + row["peak_extra_bytes"]
        for row in rows.values():
            if base and row.get("decode_tok_s") and base.get("decode_tok_s"):
                row["decode_vs_transformers"] = row["decode_tok_s"] / base["decode_tok_s"]
                row["peak_vs_transformers"] = row["turn_peak_bytes"] / base["turn_peak_bytes"]
            if row.get("kv_uncompressed_bytes"):
                row["kv_fraction"] = row["kv_bytes"] / row["kv_uncompressed_bytes"]

    sections = payload["sections"]
    if "seed" in sections:
        fill(sections["seed"]["rows"], weights, weights)
        eager = sections["seed"]["rows"].get("transformers eager")
        for row in sections["seed"]["rows"].values():
            if eager and row.get("decode_tok_s") and eager.get("decode_tok_s"):
                row["decode_vs_eager"] = row["decode_tok_s"] / eager["decode_tok_s"]
    if "scaling" in sections:
        for entry in sections["scaling"]["lengths"].values():
            fill(entry["rows"], weights, weights)
    if "quant" in sections:
        for variant in sections["quant"].values():
            fill(variant["rows"], variant["weight_read_bytes"], variant["weights_bytes"])


def _dtype_text(payload: dict) -> str:
    storage = payload.get("weight_storage")
    if storage and storage != payload["dtype"]:
        return f"{payload['dtype']} compute, weights held as {storage}"
    return payload["dtype"]


def _float32_row(rows: dict) -> str:
    row = rows.get("engine dense, float32 weights", {})
    ratio = row.get("decode_vs_transformers")
    return f"; with float32-held weights ×{ratio:.2f}" if ratio else ""


def targets(payload: dict) -> list[tuple[str, str, bool | None]]:
    """The issue's targets as (target, measured, met)."""
    out = []
    s = payload["sections"]
    if "seed" in s:
        dense = s["seed"]["rows"].get("engine dense", {})
        ratio = dense.get("decode_vs_transformers")
        if ratio:
            out.append(("engine dense decode ≥ 1.5× transformers generate (SDPA) at 1k context, same dtype",
                        f"×{ratio:.2f} ({dense['decode_tok_s']:.1f} vs "
                        f"{s['seed']['rows']['transformers sdpa']['decode_tok_s']:.1f} tok/s); "
                        f"×{dense.get('decode_vs_eager', 0):.2f} vs eager" + _float32_row(s["seed"]["rows"]),
                        ratio >= 1.5))
    if "scaling" in s and s["scaling"]["lengths"]:
        longest = max(s["scaling"]["lengths"], key=int)
        rows = s["scaling"]["lengths"][longest]["rows"]
        ours = rows.get("engine default", {})
        if ours.get("decode_vs_transformers"):
            out.append((f"CED + CSA2, {longest}-token document: decode ≥ 2.5× transformers",
                        f"×{ours['decode_vs_transformers']:.2f}", ours["decode_vs_transformers"] >= 2.5))
            base = rows["transformers sdpa"]
            extra = ours["peak_extra_bytes"] / base["peak_extra_bytes"] if base["peak_extra_bytes"] else None
            out.append((f"CED + CSA2, {longest}-token document: peak memory of the turn ≤ 60 % of transformers'",
                        f"{ours['peak_vs_transformers'] * 100:.0f} % with the weights "
                        f"({ours['turn_peak_bytes'] / MiB:.0f} vs {base['turn_peak_bytes'] / MiB:.0f} MiB); "
                        + (f"{extra * 100:.0f} % of what the turn adds above the weights" if extra else ""),
                        ours["peak_vs_transformers"] <= 0.60))
            bounded = rows.get("engine default, headroom")
            if bounded and bounded.get("peak_vs_transformers"):
                out.append((f"same, with prefill_headroom={s['scaling'].get('headroom_tokens')} tokens: peak ≤ 60 %",
                            f"{bounded['peak_vs_transformers'] * 100:.0f} % ({bounded['turn_peak_bytes'] / MiB:.0f} MiB), "
                            f"decode ×{bounded.get('decode_vs_transformers', 0):.2f}",
                            bounded["peak_vs_transformers"] <= 0.60))
            out.append((f"CED + CSA2, {longest}-token document: KV bytes ≤ 52 % of uncompressed",
                        f"{ours['kv_fraction'] * 100:.1f} %", ours["kv_fraction"] <= 0.52))
    quant = s.get("quant", {})
    bf16 = quant.get("bf16", {}).get("rows", {})
    if bf16.get("engine", {}).get("bandwidth_fraction"):
        frac = bf16["engine"]["bandwidth_fraction"]
        hf = bf16.get("transformers", {}).get("bandwidth_fraction") or 0
        ceiling = quant["bf16"].get("matvec_ceiling")
        bw = s.get("bandwidth", {}).get("bytes_per_s")
        extra = (f"; the bf16 matrix-vector kernels alone reach {ceiling['bytes_per_s'] / bw * 100:.0f} %"
                 if ceiling and bw else "")
        out.append(("decode reaches ≥ 50 % of the memory-bandwidth bound in bf16",
                    f"{frac * 100:.0f} % (transformers {hf * 100:.0f} %){extra}", frac >= 0.5))
    if "warmup" in s:
        w = s["warmup"]
        out.append(("warm TTFT ≤ 60 % of cold", f"{w['warm_over_cold'] * 100:.0f} % "
                    f"({w['warm_ttft_s'] * 1000:.0f} vs {w['cold_ttft_s'] * 1000:.0f} ms)",
                    w["warm_over_cold"] <= 0.60))
    return out


def _row_table(rows: dict, with_eager: bool = False) -> list[str]:
    head = ("| row | TTFT (ms) | decode (tok/s) | × transformers SDPA |" + (" × eager |" if with_eager else "")
            + " turn peak (MiB) | above weights (MiB) | KV (MiB) | KV vs uncompressed | MB read / token |"
            " % of bandwidth bound |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for name, r in rows.items():
        cells = [name, f"{r['ttft_s'] * 1000:.0f}", f"{r['decode_tok_s'] or 0:.1f}",
                 f"×{r.get('decode_vs_transformers', 0):.2f}"]
        if with_eager:
            cells.append(f"×{r.get('decode_vs_eager', 0):.2f}")
        frac = r.get("bandwidth_fraction")
        cells += [f"{r['turn_peak_bytes'] / MiB:.0f}", f"{r['peak_extra_bytes'] / MiB:.0f}",
                  f"{r['kv_bytes'] / MiB:.1f}", f"{r.get('kv_fraction', 1) * 100:.0f} %",
                  f"{r['bytes_per_token'] / 1e6:.0f}", f"{frac * 100:.0f} %" if frac else "–"]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def markdown(payload: dict) -> str:
    m = payload["machine"]
    s = payload["sections"]
    lines = [f"Machine: {m['cpu']}, {m['cores']} cores, {m['ram_gb']} GB RAM" + (f", {m['gpu']}" if m.get("gpu") else "")
             + f"; torch {m['torch']}, transformers {m['transformers']}; {m['date']}",
             f"Model: {payload['model']} ({_dtype_text(payload)}); mode {payload['mode']}; medians of {payload['reps']} "
             "interleaved repetitions", ""]
    if payload.get("attention_kernels"):
        lines[-1:-1] = [f"Attention kernels: {payload['attention_kernels']}"]
    dates = payload.get("section_dates") or {}
    if len(set(dates.values())) > 1:
        lines += ["Sections were run separately: " + ", ".join(f"{k} {v}" for k, v in dates.items()), ""]
    if "bandwidth" in s:
        bw = s["bandwidth"]
        lines += [f"Memory read bandwidth (best of sum / mv over {bw['buffer_bytes'] / 2**30:.2g} GiB): "
                  f"**{bw['bytes_per_s'] / 1e9:.1f} GB/s**; weights read per decoded token: "
                  f"{payload['weight_read_bytes'] / 1e6:.0f} MB", ""]
        ceiling = bw.get("matvec_ceiling")
        if ceiling:
            lines += [f"Kernel ceiling ({_dtype_text(payload)}): one matrix-vector product with every weight matrix and "
                      f"nothing else takes {ceiling['seconds'] * 1000:.1f} ms = {ceiling['bytes_per_s'] / 1e9:.1f} GB/s, "
                      f"{ceiling['bytes_per_s'] / bw['bytes_per_s'] * 100:.0f} % of the bound: no decode loop built on "
                      "these kernels can go above that.", ""]
    if "seed" in s:
        seed = s["seed"]
        lines += [f"### Input {seed['input_tokens']} tokens, output {seed['new_tokens']} (`seed` section)", ""]
        lines += _row_table(seed["rows"], with_eager=True) + [""]
    if "scaling" in s:
        lines += [f"### Long-context scaling (document, then a question; {s['scaling']['new_tokens']} tokens out)", ""]
        for length, entry in s["scaling"]["lengths"].items():
            lines += [f"Document {length} tokens (prompt {entry['prompt_tokens']}):", ""]
            lines += _row_table(entry["rows"]) + [""]
        if s["scaling"].get("headroom_tokens"):
            lines += [f"'engine default, headroom' sets prefill_headroom={s['scaling']['headroom_tokens']} tokens: "
                      "the document is compacted while it streams in (before the question is read), which bounds the "
                      "turn's peak.", ""]
        lines += [s["scaling"].get("note", ""), ""]
    if "warmup" in s:
        w = s["warmup"]
        at = f" at {w['prompt_tokens']:,} prompt tokens" if w.get("prompt_tokens") else ""
        lines += ["### Warmup", "", f"Cold TTFT {w['cold_ttft_s'] * 1000:.0f} ms, warm TTFT {w['warm_ttft_s'] * 1000:.0f} ms "
                  f"(×{w['warm_over_cold']:.2f}){at}; warmup() itself took {(w.get('warmup_s') or 0):.2f} s", ""]
    if "quant" in s:
        lines += ["### Quantized weights", "",
                  "| weights | footprint (MiB) | decode ours (tok/s) | decode transformers (tok/s) | ratio | TTFT ours (ms) | % of bandwidth bound (ours) | % (transformers) | kernel ceiling |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for name, v in s["quant"].items():
            ours, theirs = v["rows"]["engine"], v["rows"]["transformers"]
            frac = ours.get("bandwidth_fraction")
            frac_text = f"{frac * 100:.0f} %" if frac else "–"
            theirs_frac = theirs.get("bandwidth_fraction")
            ceiling = v.get("matvec_ceiling")
            bw = s.get("bandwidth", {}).get("bytes_per_s")
            ceiling_text = f"{ceiling['bytes_per_s'] / bw * 100:.0f} %" if ceiling and bw else "–"
            lines.append(f"| {name} | {v['weights_bytes'] / MiB:.0f} | {ours['decode_tok_s'] or 0:.1f} | "
                         f"{theirs['decode_tok_s'] or 0:.1f} | ×{ours.get('decode_vs_transformers', 0):.2f} | "
                         f"{ours['ttft_s'] * 1000:.0f} | {frac_text} | "
                         f"{f'{theirs_frac * 100:.0f} %' if theirs_frac else '–'} | {ceiling_text} |")
        lines.append("")
    if "load" in s:
        load = s["load"]
        first = load.get("first_load_conversion_s")
        lines += ["### Loading", "", (f"First load of the default model (GGUF → safetensors, once): {first:.1f} s; "
                                      if first else "") + f"converted load: {load['converted_load_s']:.1f} s", ""]
    checks = targets(payload)
    if checks:
        lines += ["### Targets", "", "| target | measured | met |", "|---|---|---|"]
        for target, measured, met in checks:
            lines.append(f"| {target} | {measured} | {'yes' if met else 'no'} |")
        lines.append("")
    return "\n".join(lines)


def plots(out: Path, payload: dict) -> list[str]:
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed: no plots (pip install -e '.[dev]')")
        return []
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    s = payload["sections"]
    if "seed" in s:
        rows = s["seed"]["rows"]
        names = list(rows)
        fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
        for ax, key, label, scale in ((axes[0], "decode_tok_s", "decode tok/s", 1),
                                      (axes[1], "ttft_s", "TTFT (ms)", 1000),
                                      (axes[2], "turn_peak_bytes", "turn peak (MiB)", 1 / MiB)):
            ax.barh(names, [(rows[n].get(key) or 0) * scale for n in names],
                    color=["#999999" if n.startswith("transformers") else "#2b7bba" for n in names])
            ax.set_xlabel(label)
            ax.invert_yaxis()
        axes[1].set_yticks([])
        axes[2].set_yticks([])
        fig.suptitle(f"Seed table: {s['seed']['input_tokens']} in, {s['seed']['new_tokens']} out "
                     f"({payload['model']}, {payload['dtype']}, {payload['mode']})")
        fig.tight_layout()
        fig.savefig(out / "seed.png", dpi=110)
        plt.close(fig)
        written.append("seed.png")
    if "scaling" in s and s["scaling"]["lengths"]:
        lengths = sorted(s["scaling"]["lengths"], key=int)
        names = list(s["scaling"]["lengths"][lengths[0]]["rows"])
        fig, axes = plt.subplots(1, 4, figsize=(16, 3.8))
        for ax, key, label, scale in ((axes[0], "turn_peak_bytes", "turn peak memory (MiB)", 1 / MiB),
                                      (axes[1], "kv_bytes", "KV bytes (MiB)", 1 / MiB),
                                      (axes[2], "ttft_s", "TTFT (s)", 1),
                                      (axes[3], "decode_tok_s", "decode tok/s", 1)):
            for name in names:
                ys = [(s["scaling"]["lengths"][n]["rows"][name].get(key) or 0) * scale for n in lengths]
                ax.plot([int(n) for n in lengths], ys, marker="o", label=name)
            ax.set_xlabel("document tokens")
            ax.set_ylabel(label)
            ax.set_xscale("log", base=2)
        axes[0].legend(fontsize=8)
        fig.suptitle(f"Long-context scaling ({payload['model']}, {payload['dtype']}, {payload['mode']})")
        fig.tight_layout()
        fig.savefig(out / "scaling.png", dpi=110)
        plt.close(fig)
        written.append("scaling.png")
    return written


def write(out: Path, payload: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    annotate(payload)
    payload["targets"] = [{"target": t, "measured": m, "met": met} for t, m, met in targets(payload)]
    payload["plots"] = plots(out, payload)
    (out / "bench.json").write_text(json.dumps(payload, indent=2, default=str))
    (out / "bench.md").write_text(markdown(payload))
