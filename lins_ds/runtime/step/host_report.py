"""The host time steps waited, next to what the start-up predicted (issue 59): said once, on rank 0, from its own
counters (no collective), over the steps after the first host update made Adam's moments and the step after it waited
for that. The start-up summary prices the exposed host time from timings taken before training; this line is what a
user checks it against, as ``lins memory:`` is for the peak."""

from __future__ import annotations

from typing import Optional

FROM_STEP, TO_STEP = 2, 5  # optimizer steps 3-5
PERCENT_FROM_S = 0.01  # a prediction under this is "nothing exposed": the difference is said in seconds alone


class HostTimeReport:
    """Fed the host counters (``LinsRuntime.host_stats``) after every optimizer step; ``after_step`` returns the
    line once, at ``TO_STEP``, where the same offload ran from ``FROM_STEP`` on (a re-layout builds a new one)."""

    def __init__(self):
        self._mark: Optional[tuple] = None
        self.rate: Optional[float] = None  # the worker's update rate the line said (elements per second)

    @staticmethod
    def wants(step: int) -> bool:
        """Whether ``after_step`` needs the counters after optimizer step ``step`` (two steps of a run)."""
        return step in (FROM_STEP, TO_STEP)

    def after_step(self, step: int, stats: Optional[dict], predicted_s: Optional[float],
                   priced_elems_per_s: Optional[float]) -> Optional[str]:
        if stats is None:
            return None
        if step == FROM_STEP:
            self._mark = (stats["waited_s"], stats["instance"], stats["worker_updated"])
            return None
        if step != TO_STEP or self._mark is None or self._mark[1] != stats["instance"]:
            return None
        waited = (stats["waited_s"] - self._mark[0]) / (TO_STEP - FROM_STEP)
        # the workers that finished between the two steps (those of steps 2-4 or 3-5, by when each ends)
        elems, update_s = (now - then for now, then in zip(stats["worker_updated"], self._mark[2]))
        rate = elems / update_s if update_s > 0 else None
        self.rate = rate
        return host_time_note(waited, predicted_s, rate, priced_elems_per_s)


def host_time_note(waited_s: float, predicted_s: Optional[float], rate: Optional[float],
                   priced: Optional[float]) -> str:
    """``lins host time:`` the mean wait of steps FROM_STEP+1..TO_STEP against the start-up's prediction (where the
    running plan is the one it priced), and the worker's update rate over those steps against the start-up's."""
    msg = f"lins host time: steps {FROM_STEP + 1}-{TO_STEP} waited {waited_s:.3f} s a step for the host"
    if predicted_s is not None:
        diff = f", {100 * (waited_s / predicted_s - 1):+.0f} %" if predicted_s >= PERCENT_FROM_S else ""
        msg += f" vs predicted {predicted_s:.3f} s{diff}"
    if rate is not None:
        msg += f"; the host update ran {rate / 1e9:.2f} G elements/s in training"
        if priced:
            msg += f", start-up priced {priced / 1e9:.2f}"
    return msg
