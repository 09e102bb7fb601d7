"""Pictures of a run from its recorded trace (and metrics CSV): ``python -m ds_fssdp.report RUN_DIR``.

* ``load_heatmap.png``: each expert's share of its layer's tokens over iterations (paper Figure 3);
* ``placement.png``: owners and how often each rank held a replica of each expert, replayed from
  the trace (:mod:`ds_fssdp.report.replay`), and the rows each rank computed against static EP;
* ``metrics.png`` (when the run wrote ``fssdp.metrics_csv``): straggler factor, bytes moved and
  load-prediction error per layer over steps.
"""
from ds_fssdp.report.render import find_metrics, find_trace, render

__all__ = ["find_metrics", "find_trace", "render"]
