"""The sequence length a plan is sized for, when ``lins.seq_len`` does not say it (docs/design.md §7).

A hub model's ``max_position_embeddings`` (32k-128k) is what it can read, not what a job trains at: sized for it,
activations would not fit anywhere. Without ``lins.seq_len`` the start-up plan is sized for a provisional length
(``planning.start_seq_len``) and the training batches decide. Each rank notes the longest training batch it runs
(a forward in training mode with gradients on); at the first such forward of every accumulation window (the only
point where no autograd graph holds the parameters, and where every rank is) all ranks agree on the longest seen,
over a CPU group so that no device work is waited for. The first agreement sizes the plan for that length; a later
one re-plans only where it exceeds the planned length. A re-plan that changes what runs moves the engine in memory
(``LinsRuntime.apply``, from the planner); one that does not fit fails on every rank with the length and the key. A longer batch in
the middle of a window cannot wait for a move: rank 0 warns once, naming ``lins.seq_len``, and the next window
re-plans.
"""

from __future__ import annotations

from typing import Optional

import torch

from ... import comm

def batch_length(args: tuple, kwargs: dict, micro_batch: int) -> Optional[int]:
    """The sequence length a forward's batch stands for: its tokens over the micro-batch size (so that a packed or
    padding-free batch, [1, tokens], counts as ``micro_batch`` sequences of tokens / micro_batch, as the solver sizes
    them). The tokens: ``input_ids`` (or ``inputs_embeds`` without its last dimension), else the first positional
    integer tensor of two dimensions; None where there is none (other inputs: a mask or pixels say nothing of it)."""
    ids = kwargs.get("input_ids")
    if isinstance(ids, torch.Tensor) and ids.dim() >= 2:
        tokens = ids.numel()
    elif isinstance(kwargs.get("inputs_embeds"), torch.Tensor) and kwargs["inputs_embeds"].dim() >= 3:
        tokens = kwargs["inputs_embeds"].shape[:-1].numel()
    else:
        t = next((a for a in args if isinstance(a, torch.Tensor) and a.dim() == 2 and not a.is_floating_point()
                  and a.dtype is not torch.bool), None)
        if t is None:
            return None
        tokens = t.numel()
    return -(-tokens // max(1, micro_batch))


class LengthWatch:
    """This rank's view of the training batches' lengths, and the length the plan is sized for."""

    def __init__(self, planned: int):
        self.planned = planned
        self.settled = False  # a first training batch has sized the plan
        self.longest = 0  # the longest training batch this rank ran since the last agreement
        self.agreed_at: Optional[int] = None  # the optimizer step of the last agreement
        self._warned = False

    def see(self, length: Optional[int]) -> None:
        if length is not None:
            self.longest = max(self.longest, length)

    def due(self, window_start: bool, step: int) -> bool:
        """Whether this forward is where all ranks agree: the first of a window, once per optimizer step."""
        return window_start and self.agreed_at != step

    def agree(self, step: int) -> Optional[int]:
        """Every rank's longest batch since the last agreement, the largest of them (a collective: every rank at
        the first training forward of a window); the new length to size for, or None where the plan holds."""
        self.agreed_at = step
        longest = comm.max_over_world_cpu(self.longest)
        self.longest = 0
        if longest <= 0 or (self.settled and longest <= self.planned):
            return None
        return longest

    def warn_if_longer(self, length: Optional[int]) -> None:
        """A batch in the middle of a window longer than the plan's length: said once (rank 0 says it for every
        rank; each rank knows only its own batch, so each warns where it sees one)."""
        if length is None or length <= self.planned or self._warned or not self.settled:
            return
        self._warned = True
        print(f"lins: warning: a training batch of sequence length {length} inside an accumulation window, longer "
              f"than the {self.planned} the plan is sized for (inferred from the batches; lins.seq_len not set): "
              "memory may exceed the budget until the next window re-plans. Set lins.seq_len to the longest "
              "sequence the job trains on.", flush=True)
