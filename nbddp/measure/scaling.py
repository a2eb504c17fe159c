"""``nbddp.scaling_report``: what each added worker buys, measured on the running workers.

A short timed run (a warm-up, then a few dozen steps) at world sizes 1, 2,
4, ... up to the running workers, each in a subgroup of ranks ``0..k-1`` of
the same workers (``nbddp.worker.tasks.trials.scaling_task``), so nothing restarts.
For each size: samples/s, the speed-up over one worker, the scaling
efficiency (speed-up / k), and the share of a step spent waiting on
gradient communication: one synchronised step against the same step with
gradients not reduced (``no_sync``), ``1 - local / synced``.

With ``strategy=nbddp.Pipeline(...)`` or ``nbddp.TensorParallel(...)`` the
sizes are one rank (the model whole, trained as ``dp`` says: the reference)
and then whole model-parallel groups (2, 4 ... for groups of 2); each row
says how its ranks trained (``topology``), and the "waiting on gradients"
share is the data-parallel part only (a pipeline's sends are in both steps).
"""

from __future__ import annotations

import base64
import html
from dataclasses import dataclass, field
from typing import Any

from nbddp.execution.calls import RankCall
from nbddp.session.session import get_session
from nbddp.fit.arguments import ModelLike
from nbddp.fit.parallel_checks import scaling_sizes
from nbddp.protocol.data_forms import DataLike
from nbddp.protocol.messages import ScalingRow
from nbddp.profiling.time_split import shares, split_ranks

EFFICIENT = 0.7  # below this scaling efficiency another worker buys less than 70 % of one more


def world_sizes(n: int) -> list[int]:
    """1, 2, 4, ... up to ``n``, and ``n`` itself."""
    sizes, k = [], 1
    while k < n:
        sizes.append(k)
        k *= 2
    return [*sizes, n]


@dataclass
class ScalingReport:
    """The measured rows, a recommendation in words, a plot; shown as a table and plot in Jupyter.

    ``rows``: one dict per world size: ``world_size``, ``samples_per_s``,
    ``speedup``, ``efficiency``, ``step_s``, ``comm_share`` (0-1), ``peak_mem``,
    and from the time split of the synchronised steps (``lost_shares``)
    ``data_share``, ``communication_share`` and ``wait_share``.
    """

    rows: list[dict[str, Any]]
    batch_size: int
    device: str
    recommendation: str = field(default="")

    def __post_init__(self) -> None:
        if not self.recommendation:
            self.recommendation = recommend(self.rows)

    def plot(self, figsize: tuple[float, float] = (5.0, 3.4)) -> Any:
        """A matplotlib ``Figure``: samples/s against workers, with the ideal (linear) line."""
        from nbddp.live.plot import shown_figure

        fig = shown_figure(figsize)  # shows as an image in a plain Jupyter kernel
        ax = fig.add_subplot(1, 1, 1)
        ks = [r["world_size"] for r in self.rows]
        sps = [r["samples_per_s"] for r in self.rows]
        base = self.rows[0]["samples_per_s"] / self.rows[0]["world_size"]
        ax.plot(ks, [base * k for k in ks], "--", color="#999", label="ideal (linear)")
        ax.plot(ks, sps, "o-", color="#1f77b4", label="measured")
        for k, v, r in zip(ks, sps, self.rows):
            ax.annotate(f"{r['efficiency']:.0%}", (k, v), textcoords="offset points", xytext=(4, -12), fontsize=8)
        ax.set_xlabel(f"workers ({self.device})")
        ax.set_ylabel("samples/s")
        ax.set_xticks(ks)
        ax.set_ylim(bottom=0)
        ax.set_title(f"scaling at batch size {self.batch_size} per worker", fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        return fig

    def _table(self) -> list[list[str]]:
        head = ["workers", "samples/s", "speed-up", "efficiency", "step", "waiting on gradients", "data",
                "waiting for a rank", "peak memory"]
        from nbddp.live.text import fmt_bytes

        def share(r: dict[str, Any], key: str) -> str:
            return f"{r[key]:.0%}" if key in r else "-"

        body = [[_workers(r), f"{r['samples_per_s']:,.0f}", f"{r['speedup']:.2f}x", f"{r['efficiency']:.0%}",
                 f"{r['step_s'] * 1000:.1f} ms", f"{r['comm_share']:.0%}", share(r, "data_share"),
                 share(r, "wait_share"), fmt_bytes(r["peak_mem"])] for r in self.rows]
        return [head, *body]

    def __repr__(self) -> str:
        table = self._table()
        widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
        lines = ["  ".join(v.rjust(w) for v, w in zip(row, widths)) for row in table]
        return "\n".join([f"nbddp scaling report (batch size {self.batch_size} per worker, {self.device})", *lines,
                          self.recommendation])

    def _repr_html_(self) -> str:
        from nbddp.live.plot import figure_png

        table = self._table()
        head = "".join(f"<th>{html.escape(h)}</th>" for h in table[0])
        body = "".join("<tr>" + "".join(f"<td style='text-align:right'>{html.escape(c)}</td>" for c in row) + "</tr>"
                       for row in table[1:])
        png = base64.b64encode(figure_png(self.plot())).decode("ascii")
        return (f"<div class='nbddp-scaling'><table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"
                f"<p>{html.escape(self.recommendation)}</p><img src='data:image/png;base64,{png}'/></div>")


def _workers(row: dict[str, Any]) -> str:
    """``"4"``, or ``"4 (dp=2 x pp=2 (1f1b))"`` when the ranks did not all train as data-parallel replicas."""
    topology = row.get("topology", "")
    return f"{row['world_size']} ({topology})" if topology and topology not in ("ddp", "fsdp") else str(row["world_size"])


def recommend(rows: list[dict[str, Any]]) -> str:
    """What the rows say, in words."""
    if len(rows) == 1:
        return "Only one worker is running: start more (nbddp.start(n=...)) to measure what another one buys."
    worth = [r for r in rows[1:] if r["efficiency"] >= EFFICIENT]
    last = rows[-1]
    text = (f"{last['world_size']} workers train {last['speedup']:.2f}x as many samples/s as one "
            f"({last['efficiency']:.0%} efficiency); {last['comm_share']:.0%} of a step waits on gradient "
            "communication" + (f", {last['data_share']:.0%} loads data and {last['wait_share']:.0%} waits for a "
                               "slower rank." if "data_share" in last else "."))
    if len(worth) == len(rows) - 1:
        return text + " Every added worker pays off (efficiency >= 70 %)."
    best = worth[-1]["world_size"] if worth else 1
    advice = (" Communication dominates: a larger batch per worker (nbddp.find_batch_size) or grad_accum "
              "spends less of each step waiting." if last["comm_share"] > 0.3 else
              " The step itself does not shrink: the workers compete for the same cores or memory bandwidth.")
    return text + f" Beyond {best} worker(s) each addition buys less than 70 % of one." + advice


def scaling_report(model: ModelLike, data: DataLike, *, steps: int = 20, warmup: int = 5,
                   **fit_options: Any) -> ScalingReport:
    """Time a short run at 1, 2, 4, ... workers (subgroups of the running ones); see the module docstring.

    Args:
        model, data, **fit_options: as for ``dist_fit`` (``batch_size`` is per
            worker, the same at every world size).
        steps, warmup: timed and untimed optimizer steps per world size.
    """
    from nbddp.fit.preflight import prepare
    from nbddp.worker.tasks.trials import scaling_task

    for name, value in (("steps", steps), ("warmup", warmup)):
        if isinstance(value, bool) or not isinstance(value, int) or value < (1 if name == "steps" else 0):
            raise ValueError(f"scaling_report({name}=...) must be an int >= {1 if name == 'steps' else 0}, got {value!r}")
    s = get_session()
    s.ensure_started()
    call = RankCall(s, "scaling_report")
    with s.lock:
        s.ensure_ready()
        plan = prepare(s, model, data, return_weights=False, **fit_options)
        # a model-parallel strategy: one rank (the model whole), then whole groups of ranks
        sizes = scaling_sizes(plan.cfg.strategy, plan.cfg.mesh, s.world_size, world_sizes(s.world_size))
        try:
            call.launch(scaling_task, lambda p: (s.sources.attach(plan.parcels[p.local], p), plan.cfg, plan.launch,
                                                 s.sources.attach(plan.model_parcels.get(p.local), p), sizes,
                                                 warmup, steps))
        except BaseException:
            plan.discard()
            raise
    try:
        measured = call.wait()[0]
    finally:
        plan.discard()
    return ScalingReport(rows=_rows(measured), batch_size=plan.cfg.batch_size, device=s.placements[0].device)


def _rows(measured: list[ScalingRow]) -> list[dict[str, Any]]:
    one = measured[0].samples_per_s / measured[0].world_size
    return [{"world_size": m.world_size, "samples_per_s": m.samples_per_s, "speedup": m.samples_per_s / one,
             "efficiency": m.samples_per_s / one / m.world_size, "step_s": m.step_s,
             "comm_share": max(0.0, 1.0 - m.local_step_s / m.step_s) if m.step_s > 0 else 0.0, "peak_mem": m.peak_mem,
             "topology": m.topology, **lost_shares(split_ranks(m.phase_s))}
            for m in measured]


def lost_shares(splits: list[dict[str, float]]) -> dict[str, float]:
    """Where the synchronised steps' time went besides compute, as shares averaged over the ranks.

    ``data_share`` (loading batches), ``communication_share`` (the gradient
    all-reduce that was not hidden under the backward pass, as far as the split
    sees it: the reductions outside backward) and ``wait_share`` (waiting for a
    slower rank): what an efficiency below 100 % went to.
    """
    if not splits:
        return {}
    mean = [shares(s) for s in splits]
    return {f"{p}_share": sum(m[p] for m in mean) / len(mean) for p in ("data", "communication", "wait")}
