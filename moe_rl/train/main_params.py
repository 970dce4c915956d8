"""fp32 main parameters for a low-precision model, as megatron's (distributed) optimizer keeps.

The model runs and takes gradients in bf16; the optimizer steps an fp32 copy of every
parameter (with fp32 Adam state) and writes the result back rounded to the model's dtype, so
small updates are not lost to bf16 rounding step after step.
"""
from __future__ import annotations

import torch


class MainParamsOptimizer:
    """Wraps an optimizer class around fp32 copies of ``params``; quacks like the optimizer
    (``step``, ``zero_grad``, ``state_dict``, ``load_state_dict``, ``param_groups``)."""

    def __init__(self, params, optimizer_cls=torch.optim.AdamW, **kwargs):
        self.model_params = [p for p in params]
        self.main_params = [p.detach().float().clone().requires_grad_(True) for p in self.model_params]
        self.optimizer = optimizer_cls(self.main_params, **kwargs)

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @torch.no_grad()
    def step(self):
        into, grads = [], []
        for p, main in zip(self.model_params, self.main_params):
            # fp32 gradients only for the step (zero_grad frees them): not held through the next
            # forward and backward, where they would cost 4 bytes per parameter
            main.grad = None
            if p.grad is not None:
                main.grad = torch.empty_like(main)
                into.append(main.grad)
                grads.append(p.grad)
        if grads:  # one multi-tensor copy (it casts), not a cast kernel per parameter
            torch._foreach_copy_(into, grads)
        self.optimizer.step()
        torch._foreach_copy_(self.model_params, self.main_params)  # rounds to the model's dtype

    def zero_grad(self, set_to_none: bool = True):
        for p in self.model_params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()
        for main in self.main_params:
            main.grad = None

    def state_dict(self) -> dict:
        return {"optimizer": self.optimizer.state_dict(), "main_params": [m.detach().clone() for m in self.main_params]}

    def load_state_dict(self, state: dict) -> None:
        """This wrapper's state, or a plain optimizer's over the same parameters (a checkpoint of
        a 16-bit run stepped without main params): its moments go to fp32, the main params
        start from the model's weights."""
        if "main_params" not in state:
            self.optimizer.load_state_dict(state)  # torch casts the moments to the fp32 params' dtype
            with torch.no_grad():
                torch._foreach_copy_(self.main_params, self.model_params)
            return
        self.optimizer.load_state_dict(state["optimizer"])
        with torch.no_grad():
            for main, saved, p in zip(self.main_params, state["main_params"], self.model_params):
                main.copy_(saved)
                p.copy_(saved)
