"""`pagedgen profile`'s report: tables of kernel groups and phases, and two PNG charts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from pagedgen.runtime import kernel_stats


def render(results: list[dict[str, Any]], console: Console) -> None:
    for res in results:
        b = res["backend"] + (" + CUDA graphs" if res["cuda_graphs"] else "")
        t = Table(title=f"{b}: {res['model']} {res['dtype']} on {res['device']}",
                  title_justify="left")
        cols = ["batch", "prefill tok/s", "decode tok/s", "step p50 ms", "p90 ms", "p99 ms"]
        cached = any(row.get("prefix_hit_tokens") for row in res["batches"])
        if cached:
            cols.insert(2, "prompt tok cached")
        if "decode_roofline_fraction" in res["batches"][0]:
            cols += ["roofline ms", "of roofline"]
        for c in cols:
            t.add_column(c, justify="right")
        for row in res["batches"]:
            vals = [str(row["batch"]), f"{row['prefill_tok_s']:,.0f}",
                    f"{row['decode_tok_s']:,.0f}", f"{row['step_ms_p50']:.3f}",
                    f"{row['step_ms_p90']:.3f}", f"{row['step_ms_p99']:.3f}"]
            if cached:
                vals.insert(2, f"{row['prefix_hit_tokens']:,}")
            if "decode_roofline_fraction" in row:
                vals += [f"{row['decode_roofline_ms']:.3f}",
                         f"{100 * row['decode_roofline_fraction']:.0f}%"]
            t.add_row(*vals)
        console.print(t)
        unit = "GPU" if "gpu_time_us" in res["phases"]["decode"] else "CPU"
        g = Table(title=f"{unit} time by group at batch {res['kernel_batch']} "
                        f"({res['decode_steps']} decode steps)", title_justify="left")
        for c in ("group", "prefill ms", "prefill %", "decode ms", "decode %"):
            g.add_column(c, justify="right" if c != "group" else "left")
        pre, dec = res["phases"]["prefill"], res["phases"]["decode"]
        tot_p = sum(pre["groups_us"].values()) or 1
        tot_d = sum(dec["groups_us"].values()) or 1
        for grp in kernel_stats.GROUPS:
            a, d = pre["groups_us"][grp], dec["groups_us"][grp]
            if a or d:
                g.add_row(grp, f"{a / 1000:.2f}", f"{100 * a / tot_p:.1f}", f"{d / 1000:.2f}",
                          f"{100 * d / tot_d:.1f}")
        console.print(g)
        k = Table(title="top kernels" if unit == "GPU" else "top operators", title_justify="left")
        for c in ("phase", "name", "group", "calls", "total ms", "mean µs", "share"):
            k.add_column(c, justify="left" if c in ("phase", "name", "group") else "right")
        for phase in ("prefill", "decode"):
            for row in res["phases"][phase]["top_kernels"][:10]:
                k.add_row(phase, escape(row["name"]), row["group"], str(row["calls"]),
                          f"{row['total_us'] / 1000:.2f}", f"{row['mean_us']:.1f}",
                          f"{100 * row['share']:.1f}%")
        console.print(k)
        if "roofline" in res:
            rf = res["roofline"]
            parts = [f"copy bandwidth {rf['copy_bw_tb_s']:.2f} TB/s, matmul peak "
                     f"{rf['matmul_tflop_s']:.0f} TFLOP/s (measured)"]
            if "decode_attention_tb_s" in rf:
                parts.append(f"decode attention {rf['decode_attention_tb_s']:.2f} TB/s = "
                             f"{100 * rf['decode_attention_bw_fraction']:.0f}% of copy bandwidth")
            if "prefill_attention_tflop_s" in rf:
                parts.append(f"prefill attention {rf['prefill_attention_tflop_s']:.0f} TFLOP/s "
                             f"= {100 * rf['prefill_attention_peak_fraction']:.0f}% of peak")
            if "fp8_matmul_tflop_s" in rf:
                parts.append(f"FP8 matmul peak {rf['fp8_matmul_tflop_s']:.0f} TFLOP/s "
                             "(measured)")
            if "prefill_gemm_tflop_s" in rf:
                kind = "FP8 " if "fp8_matmul_tflop_s" in rf else ""
                parts.append(f"prefill {kind}GEMMs {rf['prefill_gemm_tflop_s']:.0f} TFLOP/s = "
                             f"{100 * rf['prefill_gemm_peak_fraction']:.0f}% of {kind}peak")
            if "decode_fp8_gemm_tb_s" in rf:
                parts.append(f"decode FP8 GEMMs read weights at {rf['decode_fp8_gemm_tb_s']:.2f}"
                             f" TB/s = {100 * rf['decode_fp8_gemm_bw_fraction']:.0f}% of copy "
                             "bandwidth")
            if "decode_linear_attention_tb_s" in rf:
                parts.append(f"decode linear attention moves its state at "
                             f"{rf['decode_linear_attention_tb_s']:.2f} TB/s = "
                             f"{100 * rf['decode_linear_attention_bw_fraction']:.0f}% of copy "
                             "bandwidth")
            if rf.get("decode_step_roofline_fraction"):
                parts.append(f"whole decode step at batch {res['kernel_batch']}: "
                             f"{100 * rf['decode_step_roofline_fraction']:.0f}% of the memory "
                             f"roofline")
            console.print("roofline: " + "; ".join(parts))
        if "not_measured" in res:
            console.print(f"[yellow]note:[/] {res['not_measured']}")
    if len(results) > 1:
        _render_side_by_side(results, console)


def _render_side_by_side(results: list[dict[str, Any]], console: Console) -> None:
    t = Table(title="backends side by side", title_justify="left")
    t.add_column("metric")
    for res in results:
        t.add_column(res["backend"] + (" +graphs" if res["cuda_graphs"] else ""), justify="right")
    for i, row in enumerate(results[0]["batches"]):
        b = row["batch"]
        t.add_row(f"prefill tok/s @ batch {b}",
                  *[f"{r['batches'][i]['prefill_tok_s']:,.0f}" for r in results])
        t.add_row(f"decode step p50 ms @ batch {b}",
                  *[f"{r['batches'][i]['step_ms_p50']:.3f}" for r in results])
    for grp in ("attention", "GEMM"):
        shares = []
        for r in results:
            groups = r["phases"]["decode"]["groups_us"]
            shares.append(f"{100 * groups[grp] / (sum(groups.values()) or 1):.0f}%")
        t.add_row(f"decode {grp} share", *shares)
    console.print(t)


def charts(results: list[dict[str, Any]], out_dir: Path) -> list[Path]:
    """PNG charts: time by group per backend and phase; decode step time vs batch size."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    paths = []
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    names = [r["backend"] + (" +graphs" if r["cuda_graphs"] else "") for r in results]
    for ax, phase in zip(axes, ("prefill", "decode")):
        bottom = [0.0] * len(results)
        for grp in kernel_stats.GROUPS:
            vals = [r["phases"][phase]["groups_us"][grp] / 1000 for r in results]
            if any(vals):
                ax.bar(names, vals, bottom=bottom, label=grp)
                bottom = [b + v for b, v in zip(bottom, vals)]
        ax.set_title(f"{phase}: time by kernel group (batch {results[0]['kernel_batch']})")
        ax.set_ylabel("ms per step (kernel groups stacked: the bar is their sum)")
        ax.set_ylim(bottom=0)
    axes[1].legend(fontsize=8, loc="upper left", bbox_to_anchor=(1, 1))
    fig.tight_layout()
    paths.append(out_dir / "kernel_groups.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, r in zip(names, results):
        ax.plot([b["batch"] for b in r["batches"]], [b["step_ms_p50"] for b in r["batches"]],
                marker="o", label=name)
        if "decode_roofline_ms" in r["batches"][0]:
            ax.plot([b["batch"] for b in r["batches"]],
                    [b["decode_roofline_ms"] for b in r["batches"]], ls="--", color="gray",
                    label=f"{name} memory roofline")
    ax.set_xlabel("batch size (sequences decoding)")
    ax.set_ylabel("decode step p50 (ms, whole step: every kernel)")
    ax.set_ylim(bottom=0)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_title(f"decode step time vs batch size ({results[0]['model']})")
    ax.legend(fontsize=8)
    fig.tight_layout()
    paths.append(out_dir / "decode_step_vs_batch.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    return paths
