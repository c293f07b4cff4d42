"""Drawing a report's timeline: a Gantt chart with one row per actor."""

from __future__ import annotations

COLORS = {
    "copy": "#4C9BE8",
    "compute": "#59A14F",
    "wait": "#E8E8E8",
    "barrier": "#F28E2B",
    "link": "#B07AA1",
}


def draw(report, path, *, max_boxes: int = 4000, title: str | None = None) -> None:
    try:
        import matplotlib
    except ModuleNotFoundError as e:
        raise ModuleNotFoundError(
            f"drawing a timeline needs matplotlib: pip install 'conveyor[plot]' ({e})",
            name="matplotlib",
        ) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    boxes = list(report.boxes)
    if len(boxes) > max_boxes:  # keep the first boxes: fill and steady state are what people read
        boxes = sorted(boxes, key=lambda b: b.start)[:max_boxes]
    actors = sorted({b.actor for b in boxes}, key=actor_order)
    row = {a: i for i, a in enumerate(reversed(actors))}
    scale, unit = (1e6, "us") if report.time_s < 5e-3 else (1e3, "ms")
    fig, ax = plt.subplots(figsize=(12, 0.55 * len(actors) + 1.6))
    for b in boxes:
        width = (b.end - b.start) * scale
        if width <= 0:
            continue
        y = row[b.actor]
        ax.broken_barh(
            [(b.start * scale, width)],
            (y - 0.38, 0.76),
            facecolors=COLORS.get(b.kind, "#999999"),
            edgecolors="white",
            linewidth=0.4,
        )
        span = max((x.end for x in boxes), default=report.time_s) * scale
        if width > span / (14 if b.kind == "wait" else 28) and len(boxes) < 300:
            ax.text(
                b.start * scale + width / 2,
                y,
                b.label,
                ha="center",
                va="center",
                fontsize=6,
                clip_on=True,
            )
    ax.set_yticks(range(len(actors)))
    ax.set_yticklabels(list(reversed(actors)))
    end = max((b.end for b in boxes), default=report.time_s)
    ax.set_xlim(0, end * scale * 1.01)
    ax.set_xlabel(f"time ({unit})")
    heading = title or (
        f"{report.workload} on {report.hardware.name}: {report.time_us:.1f} us, "
        f"{report.utilization:.0%} of roofline, {report.bottleneck}-bound"
    )
    if coverage := report.timeline_coverage(max_boxes):
        heading += "\n" + coverage  # the axis ends before the run does: say why
    ax.set_title(heading, fontsize=10)
    ax.legend(
        handles=[
            Patch(color=c, label=k) for k, c in COLORS.items() if any(b.kind == k for b in boxes)
        ],
        loc="upper right",
        fontsize=7,
        ncol=5,
    )
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def actor_order(actor: str):
    """Rows in reading order: memory thread, copy engines, compute threads, links, then the rest."""
    order = ["memory thread", "copy engine", "thread", "compute", "link right", "link left"]
    for i, prefix in enumerate(order):
        if actor.startswith(prefix):
            return (i, actor)
    return (len(order), actor)
