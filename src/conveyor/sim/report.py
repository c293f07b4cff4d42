"""A simulation report: predicted time, roofline, bottleneck, busy fractions, and the timeline."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from conveyor.sim.hardware import Hardware
from conveyor.sim.timeline import actor_order, draw


@dataclasses.dataclass(frozen=True)
class Box:
    """One interval on one actor's row of the timeline."""

    actor: str  # "copy engine", "memory thread", "compute[0]", "link right", "compute", ...
    kind: str  # "copy" | "compute" | "wait" | "barrier" | "link"
    label: str
    start: float  # seconds
    end: float


@dataclasses.dataclass(frozen=True)
class Report:
    workload: str
    hardware: Hardware
    time_s: float
    flops: float
    hbm_bytes: float
    link_bytes: float
    onchip_bytes: int
    config: dict[str, Any]
    boxes: tuple[Box, ...]
    notes: tuple[str, ...] = ()
    floor_s: float | None = (
        None  # the workload's own roofline time, when the chip-level one does not apply
    )

    @property
    def time_us(self) -> float:
        return self.time_s * 1e6

    @property
    def roofline_s(self) -> float:
        """The time the hardware's peaks allow: max of compute, HBM and link time at peak rates."""
        if self.floor_s is not None:
            return self.floor_s
        hw = self.hardware
        dtype = self.config.get("dtype", "bf16")
        compute = self.flops / hw.matrix_peak_rate(dtype) if self.flops else 0.0
        memory = self.hbm_bytes / hw.hbm_bandwidth.value
        devices = self.config.get("devices", 1)
        links = 2 if self.config.get("bidirectional") else 1
        link = (
            self.link_bytes / (hw.link_bandwidth.value * links)
            if self.link_bytes and devices > 1
            else 0.0
        )
        return max(compute, memory, link)

    def call_time_s(self, dispatch_s: float, *, overlapped: bool = False) -> float:
        """Whole-call time seen from the host, for a host dispatch cost `dispatch_s` per call
        (Python, tracing-cache lookup, launch: measure yours, e.g. with an empty jitted call;
        there is no default). Calls awaited one by one (`block_until_ready` each, as a timeit
        loop does) take dispatch + device time; calls queued back to back overlap the next
        dispatch with this call's device time, so each takes the longer of the two. `time_s`
        stays device time.

        Raises:
          ValueError: `dispatch_s` negative or not a number.
        """
        if isinstance(dispatch_s, bool) or not isinstance(dispatch_s, (int, float)):
            raise ValueError(f"dispatch_s: expected seconds (a number >= 0), got {dispatch_s!r}")
        if not dispatch_s >= 0:
            raise ValueError(f"dispatch_s: expected seconds >= 0, got {dispatch_s!r}")
        if overlapped:
            return max(self.time_s, float(dispatch_s))
        return self.time_s + float(dispatch_s)

    def dispatch_bound(self, dispatch_s: float) -> bool:
        """Whether host dispatch, not the device, sets the pace of back-to-back calls."""
        return self.call_time_s(dispatch_s, overlapped=True) > self.time_s

    @property
    def utilization(self) -> float:
        """Achieved fraction of the roofline (1.0: as fast as the peaks allow)."""
        return self.roofline_s / self.time_s if self.time_s else 0.0

    @property
    def busy(self) -> dict[str, float]:
        """Fraction of the time each resource kind is busy (compute, copy, link), over the replayed
        timeline (which covers the first tiles when the rest was extrapolated)."""
        out = {}
        span = max((b.end for b in self.boxes), default=self.time_s) or self.time_s
        for kind in ("compute", "copy", "link"):
            actors = {b.actor for b in self.boxes if b.kind == kind}
            if not actors:
                continue
            per_actor = [
                sum(b.end - b.start for b in self.boxes if b.actor == a and b.kind == kind)
                for a in actors
            ]
            out[kind] = min(1.0, max(per_actor) / span)
        return out

    @property
    def bottleneck(self) -> str:
        """The resource the time is spent on: compute, memory, interconnect, or
        latency/synchronization
        when no resource is busy for most of the time (fill, drain, waits)."""
        names = {"compute": "compute", "copy": "memory", "link": "interconnect"}
        busy = self.busy
        if not busy:
            return "latency/synchronization"
        kind, frac = max(busy.items(), key=lambda kv: kv[1])
        return names[kind] if frac >= 0.6 else "latency/synchronization"

    def timeline_coverage(self, max_boxes: int | None = None) -> str | None:
        """What the timeline shows when it is not the whole run (None when it is): the replay covers
        the first tiles when the rest was extrapolated, and a drawing keeps only its first boxes."""
        boxes = sorted(self.boxes, key=lambda b: b.start)
        kept = boxes[:max_boxes] if max_boxes is not None else boxes
        end = max((b.end for b in kept), default=0.0)
        parts = []
        if end < 0.99 * self.time_s:
            why = [n for n in self.notes if n.startswith("replayed")]
            parts.append(
                f"shows the first {end * 1e6:.1f} us of the {self.time_us:.1f} us run"
                + (f" ({why[0]})" if why else "")
            )
        if len(kept) < len(boxes):
            parts.append(f"the first {len(kept)} of {len(boxes)} intervals drawn")
        return "timeline " + "; ".join(parts) if parts else None

    def to_dict(self) -> dict[str, Any]:
        return {
            "workload": self.workload,
            "hardware": self.hardware.name,
            "time_us": self.time_us,
            "utilization": self.utilization,
            "bottleneck": self.bottleneck,
            "busy": self.busy,
            "roofline_us": self.roofline_s * 1e6,
            "tflops": self.flops / self.time_s / 1e12 if self.flops else 0.0,
            "onchip_bytes": self.onchip_bytes,
            "config": self.config,
            "notes": list(self.notes),
            "timeline_coverage": self.timeline_coverage(),
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, default=str)

    def save_trace(self, path) -> None:
        """Chrome / Perfetto trace (open in ui.perfetto.dev or chrome://tracing)."""
        actors = sorted({b.actor for b in self.boxes}, key=actor_order)
        events = [
            {"name": "thread_name", "ph": "M", "pid": 0, "tid": i, "args": {"name": a}}
            for i, a in enumerate(actors)
        ]
        tid = {a: i for i, a in enumerate(actors)}
        events += [
            {
                "name": b.label,
                "cat": b.kind,
                "ph": "X",
                "pid": 0,
                "tid": tid[b.actor],
                "ts": b.start * 1e6,
                "dur": max(b.end - b.start, 0.0) * 1e6,
            }
            for b in self.boxes
        ]
        with open(path, "w") as f:
            json.dump(
                {
                    "traceEvents": events,
                    "displayTimeUnit": "ns",
                    "otherData": {"workload": self.workload, "hardware": self.hardware.name},
                },
                f,
            )

    def save_png(self, path, *, max_boxes: int = 4000, title: str | None = None) -> None:
        draw(self, path, max_boxes=max_boxes, title=title)
