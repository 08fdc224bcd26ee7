"""One neuron as the atlas reads it (:meth:`kvmem.atlas.Atlas.neuron`): statistics, triggers, projections and
histogram, shown as text in a terminal and as shaded HTML in a notebook."""

from __future__ import annotations

import html
from dataclasses import dataclass

import pandas as pd

__all__ = ["NeuronRecord"]


@dataclass
class NeuronRecord:
    """Everything the atlas knows about one neuron (memory slot)."""

    layer: int
    neuron: int
    stats: dict
    triggers: pd.DataFrame
    values: pd.DataFrame
    keys: pd.DataFrame
    histogram: pd.DataFrame  # columns bin, low, high, count
    provenance: dict

    def promoted(self, convention: str | None = None, kind: str = "promote") -> list[str]:
        frame = self.values[self.values.kind == kind]
        convention = convention or self.provenance.get("convention")
        if convention is not None:
            frame = frame[frame.convention == convention]
        return frame.sort_values("rank").token.tolist()

    def __repr__(self) -> str:
        s = self.stats
        top = self.triggers[self.triggers.kind == "top"].head(5)
        lines = [f"Neuron {self.layer}:{self.neuron} of {self.provenance.get('model')} "
                 f"(corpus {self.provenance.get('corpus')}, {s['count']:,} tokens)",
                 f"  mean {s['mean']:.4g}  std {s['std']:.4g}  min {s['min']:.4g}  max {s['max']:.4g}  "
                 f"active {s['frac_positive']:.1%}  |v| {s['value_norm']:.4g}",
                 f"  promotes ({self.provenance.get('convention')}): {self.promoted()[:10]}",
                 f"  suppresses: {self.promoted(kind='suppress')[:10]}",
                 "  top triggers:"]
        for row in top.itertuples():
            lines.append(f"    {row.activation:8.3f}  {_marked(row.context, row.span_start, row.span_end)!r}")
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        """Top and bottom triggers with every context token shaded by its coefficient (:mod:`kvmem.shading`)."""
        from kvmem.shading import cells, robust_scale, shaded_html

        s = self.stats
        top, bottom = (self.triggers[self.triggers.kind == kind] for kind in ("top", "bottom"))
        scale = robust_scale(top.activation.tolist(), bottom.activation.tolist())

        def rows(frame) -> str:
            out = []
            for row in frame.head(10).itertuples():
                tokens = list(row.context_tokens) if getattr(row, "context_tokens", None) is not None else []
                if tokens:
                    acts = getattr(row, "context_activations", None)
                    text = shaded_html(cells(tokens, [] if acts is None else list(acts), int(row.context_trigger), scale,
                                             trigger_value=float(row.activation)))
                else:
                    text = _marked_html(row.context, row.span_start, row.span_end)
                out.append(f'<tr><td style="text-align:right">{row.activation:.3f}</td>'
                           f'<td style="text-align:left;font-family:monospace">{text}</td>'
                           f"<td>{html.escape(repr(row.next_token))}</td></tr>")
            return "".join(out)

        promoted = ", ".join(html.escape(repr(t)) for t in self.promoted()[:10])
        suppressed = ", ".join(html.escape(repr(t)) for t in self.promoted(kind="suppress")[:10])
        head = '<tr><th>m</th><th style="text-align:left">context (trigger marked)</th><th>next</th></tr>'
        return (f"<div><b>L{self.layer}/{self.neuron}</b> · {html.escape(str(self.provenance.get('model')))} · "
                f"mean {s['mean']:.3g} · max {s['max']:.3g} · active {s['frac_positive']:.1%}<br>"
                f"promotes ({html.escape(str(self.provenance.get('convention')))}): {promoted}<br>"
                f"suppresses: {suppressed}<br><small>{html.escape(scale.rule)}</small>"
                f"<table><caption>top triggers</caption>{head}{rows(top)}</table>"
                f"<table><caption>bottom triggers</caption>{head}{rows(bottom)}</table></div>")


def _marked(context: str, start: int, end: int) -> str:
    return f"{context[:start]}[[{context[start:end]}]]{context[end:]}"


def _marked_html(context: str, start: int, end: int) -> str:
    return (html.escape(context[:start]) + "<mark>" + html.escape(context[start:end]) + "</mark>"
            + html.escape(context[end:]))
