"""Whole values of one parameter, whatever the plan (docs/design.md §4, "What user code sees"): the verbs DeepSpeed's
helpers reach through ``integrations/zero_api.py`` — ``safe_get_full_fp32_param`` / ``_optimizer_state`` / ``_grad``,
their ``safe_set_full_*``, and ``GatheredParameters``' write-back. A mixin of ``LinsRuntime``: the units and master
slices stay inside the runtime, and ``zero_api`` asks for a value or hands one in. These verbs touch no unit either:
they find a parameter's place through the runtime's own (``_slot``, ``_master_slices_of``, ``_grad_range_of``,
``_write_param``, ``_write_grad``)."""

from __future__ import annotations

from typing import Optional

import torch


class FullValues:
    """``LinsRuntime``'s verbs for one parameter's whole value. The reads are collectives (every rank calls them, with
    the same parameter); the writes are local (each rank writes what it holds of the value every rank was given)."""

    def full_value(self, param, key: Optional[str] = None) -> torch.Tensor:
        """The fp32 master of ``param`` (``key`` None) or its element-wise optimizer state ``key``, whole, on every
        rank: each rank of one OS replica adds the elements it holds, so the world's sum is exact."""
        self.join_host()  # masters on the host are being written by the last step's update
        slot, slices = self._slot(param), self._master_slices_of(param)
        buf = torch.zeros(slot.numel + 1, dtype=torch.float32, device=self.device)
        if self.is_checkpoint_writer:
            for sl in slices:
                src = sl.param.data if key is None else self._basic.state.get(sl.param, {}).get(key)
                for name, (a, b), (s, e) in sl.range.by_parameter():
                    if name != slot.name:
                        continue
                    if not (torch.is_tensor(src) and src.shape == sl.param.shape):
                        buf[-1] = 1.0  # no such element-wise state (yet) on this rank
                        continue
                    buf[a:b].copy_(src[s:e])
        self.sum_over_world(buf, "full-param")
        if buf[-1].item():
            raise ValueError(f"lins: parameter {slot.name} has no element-wise optimizer state {key!r} (yet): "
                             f"keys after a step: {sorted(self._state_keys())}")
        return buf[:-1].view(slot.shape)

    def write_value(self, param, value: torch.Tensor, key: Optional[str] = None) -> None:
        """``value`` (the whole parameter, the same on every rank) into the fp32 master or state ``key`` of every slice
        this rank holds, and, for the master, into the parameter this rank holds; no collective. Without an optimizer
        (a forward-only engine) the parameter is all there is."""
        if self._basic is None:
            self._write_param(param, value.detach().reshape(-1))
            return
        self.join_host()
        self.params_current()
        slot, slices = self._slot(param), self._master_slices_of(param)
        flat = value.detach().reshape(-1)
        with torch.no_grad():
            for sl in slices:
                dst = sl.param.data if key is None else self._basic.state.get(sl.param, {}).get(key)
                if not (torch.is_tensor(dst) and dst.shape == sl.param.shape):
                    raise ValueError(f"lins: parameter {slot.name} has no element-wise optimizer state {key!r}")
                for name, (a, b), (s, e) in sl.range.by_parameter():
                    if name == slot.name:
                        dst[s:e].copy_(flat[a:b])
            if key is None:
                self._write_param(param, flat)

    def full_grad(self, param, loss_scale: float) -> torch.Tensor:
        """``param``'s gradient for the window just ended, averaged over the ranks and unscaled (``loss_scale``),
        whole, on every rank; between the backward that ends a window and ``step()``."""
        self._require_window()
        self.finish_gradients()  # every replica AllReduce done (the step's own call then finds nothing to do)
        self.host_grads_final()  # G on the host: every push of the window added in
        slot = self._slot(param)
        buf = torch.zeros(slot.numel, dtype=torch.float32, device=self.device)
        r = self._grad_range_of(param)
        if self.is_checkpoint_writer and r is not None:
            grads = r.grads()
            for name, (a, b), (s, e) in r.by_parameter():
                if name == slot.name:
                    buf[a:b].copy_(grads[s:e])
        self.sum_over_world(buf, "full-grad")
        return buf.div_(self.topo.world_size * loss_scale).view(slot.shape)

    def write_grad(self, param, value: torch.Tensor, loss_scale: float) -> None:
        """``value`` (averaged over the ranks, as ``full_grad`` gives it) as the window's gradient of ``param`` in this
        rank's G accumulator; no collective."""
        self._require_window()
        self.refuse_ahead("writing a gradient (safe_set_full_grad)")
        self.finish_gradients()
        self.host_grads_final()
        self._write_grad(param, value.detach().reshape(-1).float() * (self.topo.world_size * loss_scale))
        self.host_grads_written()

    def _require_window(self) -> None:
        if not self.window_done():
            raise ValueError("lins: the full gradient is available between the backward that ends an accumulation "
                             "window and engine.step() (as under ZeRO-1/2)")

    def _state_keys(self) -> set:
        return {k for st in self._basic.state.values() for k, v in st.items() if torch.is_tensor(v) and v.dim() > 0}
