"""PNG figures next to the JSON a benchmark writes: τ and acceptance per position per source, speedup per category,
and a sweep's points. matplotlib is an optional extra (`pip install -e '.[plots]'`); without it no figure is drawn
and the caller says so once."""

from __future__ import annotations

from pathlib import Path


def pyplot():
    """matplotlib.pyplot on the file-only Agg backend, or None when matplotlib is not installed."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    fig.clf()
    return path


def plot_tau_table(rows: list[dict], path: Path, title: str = "") -> Path | None:
    """rows: train.distill's τ table ({source, k, T, tau, acceptance: "0.40 0.21 -"}). Left: τ against K per source
    and temperature; right: acceptance per position at the largest K."""
    plt = pyplot()
    if plt is None or not rows:
        return None
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    series: dict[tuple, list] = {}
    for r in rows:
        series.setdefault((r["source"], r["T"]), []).append(r)
    one_k = len({r["k"] for r in rows}) == 1  # a line through one point says nothing: bars per source instead
    for i, ((source, t), rs) in enumerate(sorted(series.items())):
        rs = sorted(rs, key=lambda r: r["k"])
        if one_k:
            bar = left.bar(i, rs[0]["tau"], label=f"{source}, T={t:g}", color=f"C{i}")
            left.bar_label(bar, fmt="%.3f", fontsize=8)
        else:
            left.plot([r["k"] for r in rs], [r["tau"] for r in rs], marker="o", label=f"{source}, T={t:g}")
        last = rs[-1]
        acc = [None if a == "-" else float(a) for a in str(last["acceptance"]).split()]
        right.plot([i + 1 for i, a in enumerate(acc) if a is not None], [a for a in acc if a is not None],
                   marker="o", color=f"C{i}", label=f"{source}, T={t:g}, K={last['k']}")
    if one_k:
        left.set(xticks=[], xlabel=f"source (K={rows[0]['k']})", title=f"τ at K={rows[0]['k']}")
    else:
        left.set(xlabel="draft length K (tree: nodes)", title="τ against K")
        left.xaxis.set_major_locator(plt.MaxNLocator(integer=True))
    left.set(ylabel="τ (tokens per target forward)")
    left.set_ylim(bottom=1.0)  # τ >= 1: every forward emits at least its bonus token
    right.set(xlabel="position", ylabel="P(accepted | previous accepted)", ylim=(0, 1.05),
              title="acceptance per position")
    right.xaxis.set_major_locator(plt.MaxNLocator(integer=True))
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    if title:
        fig.suptitle(title, fontsize=10)
    return _save(fig, path)


def plot_speedup(result: dict, path: Path) -> Path | None:
    """eval.speedup's result: speculative / plain tokens/s per category, τ written on each bar."""
    plt = pyplot()
    per = result.get("per_category", {})
    if plt is None or not per:
        return None
    cats = [c for c in per if per[c].get("speedup") is not None]
    fig, ax = plt.subplots(figsize=(max(6, 0.8 * len(cats) + 2), 4))
    bars = ax.bar(cats, [per[c]["speedup"] for c in cats], color="tab:blue")
    for bar, c in zip(bars, cats):
        if per[c].get("tau") is not None:
            ax.annotate(f"τ {per[c]['tau']:.2f}", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                        ha="center", va="bottom", fontsize=8)
    ax.axhline(1.0, color="grey", lw=1)
    ax.set(ylabel="speedup over plain decoding", title=f"{result.get('source', '')}: speedup per category")
    ax.tick_params(axis="x", rotation=30)
    return _save(fig, path)


def plot_sweep(points: list[dict], out_dir: Path) -> list[Path]:
    """points: eval.sweep_summary's ranked points. τ per point, validation curves, acceptance per position."""
    plt = pyplot()
    if plt is None or not points:
        return []
    paths = []
    fig, ax = plt.subplots(figsize=(max(6, 1.0 * len(points) + 2), 4))
    ax.bar([p["label"] for p in points], [p["tau"] or 0 for p in points], color="tab:green")
    ax.set(ylabel="τ of the trained head", title="sweep points, best first")
    ax.set_ylim(bottom=1.0 if all(p["tau"] for p in points) else 0.0)
    ax.tick_params(axis="x", rotation=30, labelsize=8)
    paths.append(_save(fig, out_dir / "sweep_tau.png"))
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    for p in points:
        steps = [v["step"] for v in p["validation"]]
        a1.plot(steps, [v.get("val_loss") for v in p["validation"]], marker=".", label=p["label"])
        a2.plot(steps, [v.get("val_tau_est") for v in p["validation"]], marker=".", label=p["label"])
    a1.set(xlabel="step", ylabel="held-out loss", title="validation loss")
    a2.set(xlabel="step", ylabel="val_tau_est", title="held-out τ estimate")
    for ax in (a1, a2):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    paths.append(_save(fig, out_dir / "sweep_validation.png"))
    fig, ax = plt.subplots(figsize=(6, 4))
    for p in points:
        acc = p["acceptance"]
        ax.plot(range(1, len(acc) + 1), acc, marker="o", label=p["label"])
    ax.set(xlabel="position", ylabel="P(accepted | previous accepted)", ylim=(0, 1.05),
           title="acceptance per position")
    ax.xaxis.set_major_locator(plt.MaxNLocator(integer=True))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    paths.append(_save(fig, out_dir / "sweep_acceptance.png"))
    return paths
